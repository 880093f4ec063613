"""`ConfigError` and the checks every section runs in `__post_init__`.

Every int setting lies in int32, JAX's default integer (x64 off): device counts (steps, batch
sizes, token budgets, seeds folded into keys) would wrap past 2**31 - 1 rather than fail. So
`Section` checks that bound on every int field, not only on those judged to reach a device."""
from __future__ import annotations

import dataclasses
import math


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def check(cond: bool, field: str, msg: str) -> None:
    """Raise `ConfigError(f"{field}: {msg}")` unless `cond`."""
    if not cond:
        raise ConfigError(f"{field}: {msg}")


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def is_int(v) -> bool:
    """An int that is not a bool, within int32 (module docstring)."""
    return isinstance(v, int) and not isinstance(v, bool) and INT32_MIN <= v <= INT32_MAX


def check_int_range(obj) -> None:
    """Every int field of the dataclass `obj` (and every int of a tuple field) within int32."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        for x in v if isinstance(v, tuple) else (v,):
            if isinstance(x, int) and not isinstance(x, bool):
                check(INT32_MIN <= x <= INT32_MAX, f.name,
                      f"{x} is outside int32 [{INT32_MIN}, {INT32_MAX}], the range the "
                      "code counts in on device; use a value within it")


def check_positive_int(obj, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        check(is_int(v) and v > 0, f, f"must be a positive int <= {INT32_MAX}, got {v!r}")


def check_choice(obj, field: str, choices) -> None:
    v = getattr(obj, field)
    check(v in choices, field, f"must be one of {tuple(choices)}, got {v!r}")


def check_bool(obj, *fields: str) -> None:
    for f in fields:
        check(isinstance(getattr(obj, f), bool), f,
              f"must be true or false, got {getattr(obj, f)!r}")


def is_finite(v) -> bool:
    """A finite int or float (not a bool, not a string)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# float32's largest finite value and smallest normal one: the model computes RoPE
# frequencies and RMSNorm in float32 (or wider), so its float settings must hold there.
FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38


def fits_float32(v) -> bool:
    """A finite number that stays finite, and nonzero if it is, in float32."""
    return is_finite(v) and abs(v) <= FLOAT32_MAX and (v == 0 or abs(v) >= FLOAT32_TINY)


def check_float_range(obj) -> None:
    """Every float field of the dataclass `obj` `fits_float32`: each runs in float32 on device,
    where an overflow (1e308) or flush to zero (1e-50) computes something else; nor is such a
    value a sane host fraction (task.test_fraction, optim.warmup_frac)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, float):
            check(fits_float32(v), f.name,
                  f"{v!r} is not a finite float32 (0, or {FLOAT32_TINY:.4g} <= |v| <= "
                  f"{FLOAT32_MAX:.4g}), the dtype it is computed in; use a value within it")


class Section:
    """Base of every config section: ints checked to lie in int32 (`check_int_range`) before the
    section's own `__post_init__`, floats to be finite float32 after it (`check_float_range`), so
    a section states only its own ranges; `cfg.replace(field=value)` re-validates."""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        own = cls.__dict__.get("__post_init__")
        if own is None and hasattr(cls, "__post_init__"):
            return  # a parent section's, which checks this class's fields too

        def __post_init__(self):
            check_int_range(self)
            if own is not None:
                own(self)
            check_float_range(self)  # after the section's own: its messages say more

        cls.__post_init__ = __post_init__

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

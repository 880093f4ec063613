"""`ConfigError` and the checks every section runs in `__post_init__`."""
from __future__ import annotations

import dataclasses
import math


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def check(cond: bool, field: str, msg: str) -> None:
    """Raise `ConfigError(f"{field}: {msg}")` unless `cond`."""
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def is_int(v) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_positive_int(obj, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        check(is_int(v) and v > 0, f, f"must be a positive int, got {v!r}")


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


class Section:
    """Base of every config section: `cfg.replace(field=value)` re-validates."""

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

"""Checks of the arrays handed to the library's public entry points
(`transformer.forward`, `logprobs.policy_logprobs`, the losses' `LossBatch`).

Always, when the call is traced (no device sync, no cost per step): ranks, shapes,
dtypes, and a non-empty batch. Host (numpy) token ids are range-checked too: they are on
the host already.

Values of device arrays only when asked: under `checks=True` (forward,
policy_logprobs) or inside `with input_checks.checking():` (anything, the losses
included), `jax.experimental.checkify.check`s test that token ids lie in [0, V) and masks
hold only 0 and 1. An eager call raises at once (a `checkify.JaxRuntimeError`, a
ValueError); a jitted one must be functionalized, `checkify.checkify(jax.jit(f))` then
`err.throw()`: jit alone cannot raise from a value. Without them, out-of-range ids are
clamped by the embedding gather and a mask of 2 weighs its token twice: the training
loop's own arrays never hold those (the sampler and the data pipeline make them), so its
jitted steps run without value checks.

Not checked: finiteness of log-probs and advantages (a non-finite input makes the loss
NaN and `rl/step_fns.apply_gradients` skips that update), and the replay tensor's values
inside jit (`moe.route` poisons an invalid row's weights so the update is skipped).
"""
from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

_CHECKING = contextvars.ContextVar("stablerl_value_checks", default=False)


@contextlib.contextmanager
def checking(on: bool = True):
    """Value checks (module docstring) for every entry point called in the block."""
    token = _CHECKING.set(on)
    try:
        yield
    finally:
        _CHECKING.reset(token)


def values_on(checks: bool | None = None) -> bool:
    return bool(checks) or _CHECKING.get()


def nonempty(shape, name: str) -> None:
    if any(n == 0 for n in shape):
        raise ValueError(f"{name}: empty batch, shape {tuple(shape)}; pass at least one "
                         "row and one position")


def tokens(tokens_BxT, vocab_size: int, *, checks: bool | None = None,
           name: str = "tokens") -> None:
    """Integer [B, T], non-empty; ids in [0, vocab_size) (host arrays always, device
    arrays under value checks)."""
    if jnp.ndim(tokens_BxT) != 2 or not jnp.issubdtype(jnp.result_type(tokens_BxT),
                                                      jnp.integer):
        raise ValueError(f"{name}: must be an integer [B, T] array, got shape "
                         f"{jnp.shape(tokens_BxT)} dtype {jnp.result_type(tokens_BxT)}")
    nonempty(jnp.shape(tokens_BxT), name)
    if isinstance(tokens_BxT, np.ndarray):
        lo, hi = tokens_BxT.min(), tokens_BxT.max()
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name}: ids must be in [0, vocab_size={vocab_size}), got "
                             f"min={lo} max={hi}")
    elif values_on(checks):
        t = jnp.asarray(tokens_BxT)
        checkify.check(jnp.all((t >= 0) & (t < vocab_size)),
                       f"{name}: ids must be in [0, vocab_size={vocab_size}), got "
                       "min={} max={}", jnp.min(t), jnp.max(t))


def mask(mask_BxT, shape, *, name: str, checks: bool | None = None) -> None:
    """A bool / int / float mask of `shape`; values in {0, 1} under value checks."""
    if tuple(jnp.shape(mask_BxT)) != tuple(shape):
        raise ValueError(f"{name}: shape {jnp.shape(mask_BxT)} must equal {tuple(shape)}")
    dtype = jnp.result_type(mask_BxT)
    if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.number)):
        raise ValueError(f"{name}: dtype {dtype} must be bool, int or float")
    if values_on(checks) and dtype != jnp.bool_:
        m = jnp.asarray(mask_BxT)
        checkify.check(jnp.all((m == 0) | (m == 1)),
                       f"{name}: values must be 0 or 1, got min={{}} max={{}}",
                       jnp.min(m), jnp.max(m))

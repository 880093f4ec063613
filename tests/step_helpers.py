"""The score and update steps' shared fixtures: a sampled rollout of the tiny config (in
float32 and float64), its rewards, and the float64 comparison of two ways to compute one
update."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg
from tolerance import assert_close

from stablerl_jax.model import transformer as tf
from stablerl_jax.rl.engine import Engine

REWARDS = np.array([1, 0, 0, 1, 1, 1, 0, 0], np.float32)


def step_engine(cfg, **kw):
    return Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID, **kw)


@functools.lru_cache(maxsize=None)
def step_rollout(seed=0):
    cfg = tiny_cfg()
    params = tf.init_params(jax.random.key(seed), cfg.model)
    b, p = 8, 8
    prompts = jax.random.randint(jax.random.key(1), (b, p), 4, 60)
    mask = jnp.ones((b, p), bool).at[:2, :3].set(False)
    ro = step_engine(cfg).sample(params, jnp.where(mask, prompts, 0), mask, jax.random.key(2))
    return cfg, params, ro


def step_rollout64():
    """`step_rollout()` with float64 params and rollout, and the float64 model config."""
    cfg, params, ro = step_rollout()
    f64 = lambda t: jax.tree.map(
        lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, t)
    model = cfg.model.replace(param_dtype="float64", compute_dtype="float64")
    return cfg, f64(params), f64(ro), model


def assert_same_update(first, second, *, cfg, n, tokens):
    """Two (params, metric pairs) results of one update computed two ways, in float64
    within the chain of `n` roundings."""
    (p0, m0), (p1, m1) = first[:2], second[:2]
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):
        assert_close(a, b, n=n, dtype="float64", cond=tokens, scale="max")
    # Every metric numerator sums at most `den` per-token terms, each at most
    # max_log_ratio² in size (the largest: a squared clipped log-ratio).
    term = cfg.loss.max_log_ratio ** 2
    for k in m0:
        for i in range(2):
            assert_close(m1[k][i], m0[k][i], n=n, dtype="float64",
                         scale=term * max(float(np.max(m0[k][1])), 1.0), err_msg=k)

"""What the loss tests share: tiny hand-sized batches, their float32 rounding count, and
each loss's jitted value and gradient."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax.method import losses
from stablerl_jax.method.losses import LossBatch

L = np.log
# float32 roundings behind a hand-sized loss value or gradient entry. A weight
# exp(log a − log b): the inputs' float32 roundings are absolute errors ≤ 2.3u each
# (|log p| ≤ 2.3), which the difference (1) and exp (1) turn into relative error: ≤ 7.
# Then the product keep·w·Â·log π with log π's own rounding (3), the sums over tokens and
# responses (2), the aggregation's division (1) and a length normalization (1): 14.
# Values whose terms cancel pass their cond.
N = 14


def batch_of(logp, old, mu, adv, mask):
    return (jnp.asarray(L(logp), jnp.float32),
            LossBatch(old_logp_BxT=jnp.asarray(L(old), jnp.float32),
                      rollout_logp_BxT=jnp.asarray(L(mu), jnp.float32),
                      mask_BxT=jnp.asarray(mask, jnp.float32),
                      advantages_B=jnp.asarray(adv, jnp.float32)))


# Response 0: Â=+1, ρ = π_θ/μ = [2, 0.8], r = π_θ/π_old = [1, 0.8] (kept), engine
# π_old/μ = [2, 1]. Response 1: Â=−1, r_0 = 0.5 < 0.8 → masked by the clip; its second
# token is padding.
LOGP, BATCH = batch_of(logp=[[0.5, 0.4], [0.1, 0.9]], old=[[0.5, 0.5], [0.2, 0.9]],
                     mu=[[0.25, 0.5], [0.2, 0.9]], adv=[1.0, -1.0], mask=[[1, 1], [1, 0]])
# Same shapes, μ = π_old: response 0 has r = [1.5 (clipped at 1.27), 1.0], response 1 r = 0.5.
LOGP2, BATCH2 = batch_of([[0.75, 0.5], [0.1, 0.9]], [[0.5, 0.5], [0.2, 0.9]],
                       [[0.5, 0.5], [0.2, 0.9]], [1.0, -1.0], [[1, 1], [1, 0]])


@functools.partial(jax.jit, static_argnums=(0, 1))
def vg(name, cfg, logp, batch):
    """((loss, metrics), d loss / d logp) of loss `name`, jitted."""
    return jax.value_and_grad(lambda lp: losses.LOSSES[name](lp, batch, cfg), has_aux=True)(logp)


def value_and_grad(name, cfg, logp=LOGP, batch=BATCH):
    """(loss, d loss / d logp) of loss `name`, jitted."""
    (v, _), g = vg(name, cfg, logp, batch)
    return v, g

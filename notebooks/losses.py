# %% [markdown]
# # Surrogate losses, called jitted
#
# Every loss in `stablerl_jax.losses.LOSSES` has the signature
# `loss_fn(logp_BxT, batch, cfg) -> (loss, metrics)`: `logp_BxT` are the training policy's
# log-probs π_θ(y_t) of the sampled tokens, `batch` holds the old policy's log-probs
# (π_old), the inference engine's (μ_old), advantages and the completion mask, and `cfg`
# is a frozen `LossConfig` (static under `jit`). The gradient of the loss with respect to
# `logp_BxT` is each token's weight in the policy gradient, so plotting it shows what a
# loss does: MiniRL (Eq. 7) weights Â by the capped IS ratio π_θ/μ_old and masks clipped
# tokens; its ablations drop the IS weight, the clipping, or normalize by length; GRPO,
# CISPO and GSPO weight tokens their own way.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from stablerl_jax import diagnostics, losses
from stablerl_jax.config import LossConfig

# %% [markdown]
# A synthetic batch of 8 responses × 12 tokens (ragged lengths). μ_old and π_old differ by
# a small engine mismatch; π_θ has moved away from π_old by a larger staleness step, as in
# the later mini-batches of an off-policy step.

# %%
B, T = 8, 12
k = jax.random.split(jax.random.key(0), 3)
lengths = jnp.array([12, 10, 8, 12, 6, 12, 9, 11])
mask = (jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.float32)
rollout_logp = -jax.random.uniform(k[0], (B, T), minval=0.05, maxval=3.0)
old_logp = rollout_logp + 0.05 * jax.random.normal(k[1], (B, T))     # engine mismatch
logp = old_logp + 0.3 * jax.random.normal(k[2], (B, T))              # staleness
adv = jnp.array([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25])
batch = {"old_logp_BxT": old_logp, "rollout_logp_BxT": rollout_logp,
         "advantages_B": adv, "mask_BxT": mask}

CONFIGS = {
    "MiniRL": LossConfig(),
    "MiniRL + length norm": LossConfig(aggregation="seq_mean_token_mean"),
    "MiniRL w/o IS": LossConfig(use_is=False),
    "MiniRL no clip": LossConfig(clip=False),
    "GRPO": LossConfig(name="grpo"),
    "CISPO": LossConfig(name="cispo"),
    "GSPO": LossConfig(name="gspo"),
}


def loss_and_token_weights(cfg, logp, batch):
    """Loss, reduced metrics and −∂loss/∂logp (the per-token policy-gradient weight)."""
    fn = jax.jit(jax.value_and_grad(losses.LOSSES[cfg.name], has_aux=True), static_argnums=2)
    (loss, metrics), grad = fn(logp, batch, cfg)
    return float(loss), losses.reduce_metrics([metrics]), -np.asarray(grad)


results = {name: loss_and_token_weights(cfg, logp, batch) for name, cfg in CONFIGS.items()}
for name, (loss, metrics, _) in results.items():
    print(f"{name:22s} loss {loss:+.4f}   clip high {metrics.get('clip/frac_high', 0):.3f}"
          f"   clip low {metrics.get('clip/frac_low', 0):.3f}")

# %% [markdown]
# ## Per-token weights, side by side
# Red pushes a token's log-prob up, blue down; padding is zero. MiniRL's weights are
# Â · min(π_θ/μ_old, C) / B except where the clipping mask drops a token; w/o IS the
# weights are just ±Â / B.

# %%
fig, axes = plt.subplots(1, len(results), figsize=(3 * len(results), 3), sharey=True)
vmax = max(np.abs(w).max() for _, _, w in results.values())
for ax, (name, (_, _, w)) in zip(axes, results.items()):
    ax.imshow(w, cmap="coolwarm", vmin=-vmax, vmax=vmax)
    ax.set_title(name, fontsize=8)
    ax.set_xlabel("token")
axes[0].set_ylabel("response")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The clipping mask
# Tokens that MiniRL drops are exactly those where its weight is zero but the unclipped
# loss's is not: Â > 0 with r = π_θ/π_old > 1 + ε_high, or Â < 0 with r < 1 − ε_low.

# %%
dropped = (results["MiniRL"][2] == 0) & (results["MiniRL no clip"][2] != 0)
fractions = diagnostics.clip_fractions(logp, old_logp, adv, mask, CONFIGS["MiniRL"].eps_low,
                                       CONFIGS["MiniRL"].eps_high)
frac = sum(float(n) for n, _ in fractions.values()) / float(jnp.sum(mask))
print(f"dropped tokens: {int(dropped.sum())} of {int(mask.sum())}; "
      f"diagnostics.clip_fractions says {frac:.3f} of tokens")
assert abs(dropped.sum() / mask.sum() - frac) < 1e-6
plt.figure(figsize=(4, 3))
plt.imshow(dropped, cmap="Greys")
plt.title("MiniRL clipping mask (black = dropped)", fontsize=9)
plt.show()

# %% [markdown]
# ## Eq. 5: the IS ratio as engine × staleness
# log(π_θ/μ_old) = log(π_old/μ_old) + log(π_θ/π_old). The engine factor is the
# training–inference mismatch (what routing replay R3 shrinks); the staleness factor is
# the policy drift between mini-batches (it grows with the number of updates N).

# %%
eq5 = losses.reduce_metrics([diagnostics.eq5_factors(logp, old_logp, rollout_logp, mask)])
for key in ("engine", "staleness"):
    print(f"{key:9s} log factor: mean {eq5[f'eq5/{key}_log_mean']:+.4f}, "
          f"std {eq5[f'eq5/{key}_log_std']:.4f}")
m = np.asarray(mask, bool)
plt.figure(figsize=(4, 3))
plt.hist(np.asarray(old_logp - rollout_logp)[m], bins=20, alpha=0.6, label="engine")
plt.hist(np.asarray(logp - old_logp)[m], bins=20, alpha=0.6, label="staleness")
plt.xlabel("log factor")
plt.legend()
plt.show()

# %% [markdown]
# ## A check: on-policy, MiniRL is REINFORCE
# With π_θ = π_old = μ_old every ratio is 1: nothing is clipped, the IS weight is 1, and
# the token weight is Â / B on every completion token.

# %%
on_policy = dict(batch, old_logp_BxT=rollout_logp)
_, _, w = loss_and_token_weights(LossConfig(), rollout_logp, on_policy)
np.testing.assert_allclose(w, np.asarray(adv[:, None] * mask / B), rtol=1e-6, atol=1e-7)
print("on-policy MiniRL token weights == Â / B")

# %% [markdown]
# # Surrogate losses, called jitted
#
# The paper optimizes a token-level surrogate whose gradient is the first-order
# approximation of the sequence-level objective: Σ_t w_t · Â · ∇log π_θ(y_t), with a
# per-token weight w_t. Every loss in `stablerl_jax.method.losses.LOSSES` has the signature
# `loss_fn(logp_BxT, batch, cfg) -> (loss, metrics)`: `logp_BxT` are the training
# policy's log-probs π_θ(y_t) of the sampled tokens, `batch` holds the old policy's
# log-probs (π_old), the inference engine's (μ_old), advantages and the completion mask,
# and `cfg` is a frozen `LossConfig` (static under `jit`).
#
# −∂loss/∂logp_BxT is therefore each token's weight in the policy gradient, and plotting
# it shows what a loss does. MiniRL (Eq. 7) weights Â by the capped IS ratio
# min(π_θ/μ_old, C) and masks tokens whose staleness ratio π_θ/π_old left the clip range
# in the direction Â pushes; its ablations add length normalization or drop the IS
# weight or the clipping; GRPO, CISPO and GSPO weight tokens their own way.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from stablerl_jax.config import LossConfig
from stablerl_jax.method import diagnostics, losses

# %% [markdown]
# A synthetic batch of 8 responses × 12 tokens (ragged lengths). μ_old and π_old differ by
# a small engine mismatch; π_θ has moved away from π_old by a larger staleness step, as in
# the later mini-batches of an off-policy step. The loss settings are the library's named
# presets (`losses.LOSS_PRESETS`), the ones the experiments run.

# %%
B, T = 8, 12
k = jax.random.split(jax.random.key(0), 3)
lengths = jnp.array([12, 10, 8, 12, 6, 12, 9, 11])
mask = (jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.float32)
rollout_logp = -jax.random.uniform(k[0], (B, T), minval=0.05, maxval=3.0)
old_logp = rollout_logp + 0.05 * jax.random.normal(k[1], (B, T))     # engine mismatch
logp = old_logp + 0.3 * jax.random.normal(k[2], (B, T))              # staleness
adv = jnp.array([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25])
batch = losses.LossBatch(old_logp_BxT=old_logp, rollout_logp_BxT=rollout_logp,
                         mask_BxT=mask, advantages_B=adv)

CONFIGS = {label: losses.LOSS_PRESETS[name] for label, name in [
    ("MiniRL", "minirl"), ("MiniRL + length norm", "minirl_length_norm"),
    ("MiniRL w/o IS", "minirl_no_is"), ("MiniRL no clip", "minirl_no_clip"),
    ("GRPO", "grpo"), ("CISPO", "cispo"), ("GSPO", "gspo")]}


def loss_and_token_weights(cfg, logp, batch):
    """Loss, reduced metrics and −∂loss/∂logp (the per-token policy-gradient weight)."""
    fn = jax.jit(jax.value_and_grad(losses.LOSSES[cfg.name], has_aux=True), static_argnums=2)
    (loss, metrics), grad = fn(logp, batch, cfg)
    return float(loss), diagnostics.reduce_metrics([metrics]), -np.asarray(grad)


results = {name: loss_and_token_weights(cfg, logp, batch) for name, cfg in CONFIGS.items()}
for name, (loss, metrics, _) in results.items():
    print(f"{name:22s} loss {loss:+.4f}   clip high {metrics['clip/frac_high']:.3f}"
          f"   clip low {metrics['clip/frac_low']:.3f}   IS weight mean "
          f"{metrics['is/weight_mean']:.3f}")

# %% [markdown]
# ## Per-token weights, side by side
# Red pushes a token's log-prob up, blue down; padding is blank. Each panel has its own
# colour scale (its maximum |weight| is in the title): the aggregations differ by
# constant factors (1/B, 1/(B·|y|) or 1/Σ|y|), the patterns are what differ. MiniRL's
# weights are Â · min(π_θ/μ_old, C) / B except where the clipping mask drops a token;
# w/o IS they are just ±Â / B; length normalization also divides by |y|.

# %%
fig, axes = plt.subplots(2, 4, figsize=(13, 5), sharex=True, sharey=True)
cmap = plt.get_cmap("coolwarm").with_extremes(bad="white")
for ax, (name, (_, _, w)) in zip(axes.flat, results.items()):
    vmax = np.abs(w).max()
    ax.imshow(np.ma.masked_where(np.asarray(mask) == 0, w), cmap=cmap, vmin=-vmax, vmax=vmax)
    ax.set_title(f"{name}  (max |w| {vmax:.3f})", fontsize=8)
axes.flat[-1].axis("off")
for ax in axes[:, 0]:
    ax.set_ylabel("response")
for ax in axes[-1]:
    ax.set_xlabel("token")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## One token's weight as its ratio moves
# A single one-token response with μ_old = π_old, so the staleness ratio r = π_θ/π_old is
# also the full IS ratio. Sweeping r shows each loss's trust region: MiniRL and GRPO stop
# the gradient once r leaves [1 − ε_low, 1 + ε_high] in the direction Â pushes; CISPO
# never drops a token, it clips the weight; GSPO's sequence ratio has a much tighter
# range; without clipping MiniRL's weight follows r up to the cap C = 5. For a single
# token with μ_old = π_old, MiniRL's gradient coincides with GRPO's (the wide pale line).

# %%
ratios = jnp.linspace(0.5, 1.6, 200)  # no grid point sits on a clip boundary
one = losses.LossBatch(old_logp_BxT=jnp.full((1, 1), -1.0),
                       rollout_logp_BxT=jnp.full((1, 1), -1.0), mask_BxT=jnp.ones((1, 1)))


def weight_vs_ratio(cfg, a):
    """−∂loss/∂log π_θ of a one-token response with Â = a, at each ratio r."""
    b1 = one._replace(advantages_B=jnp.array([a]))
    grad = jax.vmap(jax.grad(lambda lp: losses.LOSSES[cfg.name](lp, b1, cfg)[0]))
    return -jax.jit(grad)(jnp.log(ratios)[:, None, None] - 1.0)[:, 0, 0]


STYLE = {"MiniRL": {"linewidth": 5, "alpha": 0.35}, "MiniRL no clip": {"linestyle": "--"}}
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), sharey=True)
for ax, a in zip(axes, (1.0, -1.0)):
    for name in ("MiniRL", "MiniRL no clip", "GRPO", "CISPO", "GSPO"):
        ax.plot(ratios, weight_vs_ratio(CONFIGS[name], a), label=name, **STYLE.get(name, {}))
    ax.axvline(1.0, color="grey", linewidth=0.5)
    ax.set_title(f"Â = {a:+.0f}", fontsize=9)
    ax.set_xlabel("r = π_θ / π_old")
axes[0].set_ylabel("token weight −∂loss/∂log π_θ")
axes[0].legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The clipping mask
# Tokens that MiniRL drops are exactly those where its weight is zero but the unclipped
# loss's is not: Â > 0 with r = π_θ/π_old > 1 + ε_high, or Â < 0 with r < 1 − ε_low.
# `diagnostics.clip_fractions`, the monitor the trainer logs, counts the tokens of the
# loss's clip mask (`losses.clip_sides`); it must count exactly the dropped ones.

# %%
dropped = (results["MiniRL"][2] == 0) & (results["MiniRL no clip"][2] != 0)
minirl = CONFIGS["MiniRL"]
hi, lo = losses.clip_sides(adv[:, None], logp - old_logp, 1 - minirl.eps_low,
                           1 + minirl.eps_high, minirl.clip)
fractions = diagnostics.reduce_metrics([diagnostics.clip_fractions(hi, lo, mask)])
frac = fractions["clip/frac_high"] + fractions["clip/frac_low"]
print(f"dropped tokens: {int(dropped.sum())} of {int(mask.sum())}; "
      f"diagnostics.clip_fractions says {frac:.3f} of tokens")
rtol = 2 * 2 * 2**-24  # n = 2: one float32 division (+1 for the float64 ones), cond 1
np.testing.assert_allclose(dropped.sum() / mask.sum(), frac, rtol=rtol)
plt.figure(figsize=(4, 3))
plt.imshow(np.ma.masked_where(np.asarray(mask) == 0, dropped), cmap="Greys", vmin=0, vmax=1)
plt.title("MiniRL clipping mask (black = dropped)", fontsize=9)
plt.xlabel("token")
plt.ylabel("response")
plt.show()

# %% [markdown]
# ## Eq. 5: the IS ratio as engine × staleness
# π_θ/μ_old = (π_old/μ_old) · (π_θ/π_old). The engine factor is the training–inference
# mismatch (what Routing Replay R3 shrinks for an MoE); the staleness factor is the policy
# drift between mini-batches (it grows with the number of updates N per batch). The
# losses log the same split, so `diagnostics.eq5_factors` and the loss metrics agree.

# %%
eq5 = diagnostics.reduce_metrics([diagnostics.eq5_factors(logp, old_logp, rollout_logp, mask)])
for key in ("engine", "staleness"):
    print(f"{key:9s} log factor: mean {eq5[f'eq5/{key}_log_mean']:+.4f}, "
          f"std {eq5[f'eq5/{key}_log_std']:.4f}")
    # n = 100: log-ratio, square, Σ over B·T = 96 tokens (float32); cond ≈ 1 (sqmean ≫
    # mean², and the square root halves the relative error)
    rtol = 2 * 100 * 2**-24
    np.testing.assert_allclose(eq5[f"eq5/{key}_log_std"],
                               results["MiniRL"][1][f"eq5/{key}_log_std"], rtol=rtol)
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
# with MiniRL's response-sum aggregation the token weight is Â / B on every completion
# token (the first-order surrogate's gradient is exactly the REINFORCE gradient here).

# %%
on_policy = batch._replace(old_logp_BxT=rollout_logp)
_, _, w = loss_and_token_weights(LossConfig(), rollout_logp, on_policy)
rtol = 2 * 4 * 2**-24  # n = 4: exp of the log-ratio, × Â, × mask, ÷ B; cond 1
np.testing.assert_allclose(w, np.asarray(adv[:, None] * mask / B), rtol=rtol)
print("on-policy MiniRL token weights == Â / B")

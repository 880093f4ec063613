# %% [markdown]
# # Routing mismatch between the inference and training engines
#
# The sampling path (μ, the "inference engine") runs the same MoE with different numerics
# than the training path (π): here exact (identical computation), bf16 weights and
# activations, and FP8 (e4m3) weights. Small logit differences flip top-k expert choices,
# and a flipped expert changes the token's log-prob far more than the rounding itself.
# Routing Replay fixes the experts of the training forward: R3 replays the experts the
# inference engine used (`routes_mu`), R2 those of the training engine at θ_old
# (`routes_old`). A small random model keeps this under a minute on a CPU.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from stablerl_jax import mismatch, rollout
from stablerl_jax.config import ModelConfig
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import steps

cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_experts=8, top_k=2, expert_ffn_dim=32, max_seq_len=40,
                  moe_tile=8, init_std=0.1)
params = tf.init_params(jax.random.key(0), cfg)
sampling = rollout.SamplingConfig(max_new_tokens=24, eos_id=3, pad_id=0)
B, P = 32, 8
prompts = jax.random.randint(jax.random.key(1), (B, P), 4, cfg.vocab_size)
prompt_mask = jnp.ones((B, P), bool)

# %% [markdown]
# ## Sample with each numerics preset, measure against the training path

# %%
PRESETS = ("exact", "bf16", "fp8")
rollouts, stats = {}, {}
for name in PRESETS:
    rollouts[name] = rollout.sample(params, prompts, prompt_mask, jax.random.key(2), cfg,
                                    sampling, nx.preset(name))
    stats[name] = mismatch.measure_mismatch(params, rollouts[name], cfg)
    s = stats[name]
    print(f"{name:5s} KL k1 {s['kl_k1']:+.2e}  k3 {s['kl_k3']:.2e}  "
          f"mean |Δlogp| {s['abs_logp_gap_mean']:.2e}  routing mismatch "
          f"{s['routing_mismatch']:.4f}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3))
x = np.arange(cfg.num_layers)
for i, name in enumerate(PRESETS):
    axes[0].bar(x + 0.25 * i, stats[name]["routing_mismatch_per_layer"], width=0.25, label=name)
axes[0].set_xticks(x + 0.25, [f"layer {i}" for i in x])
axes[0].set_title("routing mismatch per layer (fraction of expert slots)", fontsize=9)
axes[0].legend()
axes[1].bar(PRESETS, [max(stats[n]["kl_k3"], 1e-12) for n in PRESETS])
axes[1].set_yscale("log")
axes[1].set_title("training–inference KL (k3)", fontsize=9)
fig.tight_layout()
plt.show()

# The exact preset computes what the training path computes; FP8 is the stress case.
assert stats["exact"]["abs_logp_gap_max"] < 1e-4 and stats["exact"]["routing_mismatch"] == 0
assert stats["fp8"]["kl_k3"] > stats["exact"]["kl_k3"]

# %% [markdown]
# ## What replay does to the training engine's log-prob gap
# On the FP8 rollout, compute the training path's log-probs three ways and compare them to
# the inference engine's `logp_mu`: live routing, R3 (replay `routes_mu`) and R2 (replay
# `routes_old`, recorded by the score step at θ_old). At θ = θ_old R2 is a no-op: it
# replays the routes the training engine would pick anyway. After an update (θ ≠ θ_old,
# simulated by a small perturbation) R2 keeps θ_old's experts, R3 keeps μ's.

# %%
ro = rollouts["fp8"]
batch = steps.train_batch(ro, jnp.zeros((B,)))
scored = steps.score(params, batch, cfg=cfg, replay="r2", temperature=1.0, impl="chunked")
batch.update(scored)
m = np.asarray(batch["mask_BxT"], bool)
leaves, tree = jax.tree.flatten(params)
keys = jax.random.split(jax.random.key(3), len(leaves))
theta = jax.tree.unflatten(tree, [p + 0.02 * jax.random.normal(k_, p.shape)
                                  for p, k_ in zip(leaves, keys)])


def gap(p, mode):
    logp, _, _ = steps.policy_logprobs(p, batch, cfg, replay_LxBxTxK=steps.replay_for(mode, batch))
    return np.abs(np.asarray(logp - batch["rollout_logp_BxT"]))[m]


gaps = {(when, mode): gap(p, mode) for when, p in (("θ_old", params), ("θ", theta))
        for mode in ("none", "r2", "r3")}
for (when, mode), g in gaps.items():
    print(f"{when:5s} replay={mode:4s} mean |logp_train − logp_mu| = {g.mean():.3e}")

# At θ_old, R2 is exactly the live routing; R3 removes the routing part of the gap.
np.testing.assert_array_equal(gaps[("θ_old", "r2")], gaps[("θ_old", "none")])
assert gaps[("θ_old", "r3")].mean() <= gaps[("θ_old", "none")].mean()

# %%
fig, ax = plt.subplots(figsize=(6, 3))
labels = [f"{w}\n{mode}" for (w, mode) in gaps]
ax.bar(labels, [g.mean() for g in gaps.values()])
ax.set_yscale("log")
ax.set_title("mean |training log-prob − inference log-prob| on the FP8 rollout", fontsize=9)
fig.tight_layout()
plt.show()

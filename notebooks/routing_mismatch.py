# %% [markdown]
# # Routing mismatch between the inference and training engines
#
# The sampling path (μ, the "inference engine") runs the same MoE with different numerics
# than the training path (π): exact (identical computation), bitwise (identical
# computation, each token on its own), bf16 weights and activations, or FP8 (e4m3) weights. Small logit differences flip top-k expert choices, and a flipped
# expert changes a token's log-prob far more than the rounding itself. This is the
# training–inference factor π_old/μ_old of the token IS ratio (Eq. 5).
#
# Routing Replay fixes the experts of the training forward: **R3** replays the experts the
# inference engine used (`routes_mu`), **R2** those the training engine chose at θ_old
# (`routes_old`, recorded by the π_old scoring pass).
#
# A small random model keeps this notebook under a minute on a CPU. It uses the `dense`
# expert dispatch (every expert on every token, combined with the routing weights): the
# reference path, equal to the default dropless `grouped` one up to rounding and several
# times faster to compile at this size. Routing, replay and numerics are the same on both.

# %%
import dataclasses

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from stablerl_jax.config import (
    INFERENCE_NUMERICS,
    ExperimentConfig,
    ModelConfig,
    RLConfig,
    SamplingConfig,
)
from stablerl_jax.method import diagnostics, mismatch
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import step_fns
from stablerl_jax.sampling import rollout

cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_experts=8, top_k=2, expert_ffn_dim=32, max_seq_len=40,
                  moe_tile=8, init_std=0.1, dispatch="dense")
params = tf.init_params(jax.random.key(0), cfg)
sampling = SamplingConfig(max_new_tokens=24)
EOS, PAD = 3, 0  # a tokenizer's special ids (SentencePiece's here)
B, P = 32, 8
prompts = jax.random.randint(jax.random.key(1), (B, P), 4, cfg.vocab_size)
prompt_mask = jnp.ones((B, P), bool)

# %% [markdown]
# ## Sample with each numerics preset, measure against the training path
# `mismatch.measure_mismatch` re-scores each rollout with the training path (train
# numerics, live routing) and compares it with the sampler's `logp_mu` and `routes_mu`:
# k1 / k3 estimates of KL(μ‖π) and the per-layer fraction of top-k expert slots that
# differ.

#
# `bitwise` computes each token on its own (`ModelConfig.batch_invariant`, which the
# trainer then uses too): its rows do not depend on the shape of the call they are in, so
# the sampler's log-probs and experts are the trainer's, bit for bit.

# %%
rollouts, stats = {}, {}
for name in INFERENCE_NUMERICS:
    model = dataclasses.replace(cfg, batch_invariant=name == "bitwise")
    rollouts[name] = rollout.sample(params, prompts, prompt_mask, jax.random.key(2), model,
                                    sampling, nx.numerics_preset(name), eos_id=EOS, pad_id=PAD)
    stats[name] = mismatch.measure_mismatch(params, rollouts[name], model)
    s = stats[name]
    print(f"{name:5s} KL k1 {s['kl_k1']:+.2e}  k3 {s['kl_k3']:.2e}  "
          f"mean |Δlogp| {s['abs_logp_gap_mean']:.2e}  routing mismatch "
          f"{s['routing_mismatch']:.4f}  tokens with a flipped expert {s['routing_any_flip']:.3f}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3))
x = np.arange(cfg.num_layers)
for i, name in enumerate(INFERENCE_NUMERICS):
    axes[0].bar(x + 0.2 * i, stats[name]["routing_mismatch_per_layer"], width=0.2, label=name)
axes[0].set_xticks(x + 0.3, [f"layer {i}" for i in x])
axes[0].set_title("routing mismatch per layer (fraction of expert slots)", fontsize=9)
axes[0].legend()
axes[1].bar(INFERENCE_NUMERICS, [max(stats[n]["kl_k3"], 1e-16) for n in INFERENCE_NUMERICS])
axes[1].set_yscale("log")
axes[1].set_title("training–inference KL(μ‖π), k3 estimate", fontsize=9)
fig.tight_layout()
plt.show()

# The exact preset computes what the training path computes (up to float32 summation
# order); FP8 is the stress case. n = 796 float32 roundings of a log-prob (the forward over
# 32 slots, the logit dot and log-sum-exp; tests/tolerance.py `engine_chain`), cond 1, in
# the probabilistic bound (λ = 6) the tests use for the exact engine; relative to max |logp|.
rtol = 2 * 6 * 796**0.5 * 2**-24
logp_scale = np.abs(np.asarray(rollouts["exact"].logp_mu_BxS)).max()
assert stats["exact"]["abs_logp_gap_max"] <= rtol * logp_scale
assert stats["exact"]["routing_mismatch"] == 0
assert stats["bitwise"]["abs_logp_gap_max"] == 0 and stats["bitwise"]["routing_mismatch"] == 0
assert stats["fp8"]["kl_k3"] > stats["bf16"]["kl_k3"] > stats["exact"]["kl_k3"]
assert stats["fp8"]["routing_mismatch"] > 0

# %% [markdown]
# ## Eq. 5 under each replay mode
# On the FP8 rollout, the training engine's log-probs split the IS ratio π_θ/μ_old into
# an **engine** factor π_old/μ_old and a **staleness** factor π_θ/π_old. For each replay
# mode, the trainer's score step (`step_fns.score`) gives π_old at θ_old (R3 replays
# `routes_mu` already here; none and R2 route live) and the batch's replay tensor (R2: the
# routes π_old used), and `policy_logprobs` with that replay gives π_θ, as in the update
# step. θ stands for the parameters after some updates: θ_old plus a small random
# perturbation.
#
# Expected: R3 shrinks the engine factor (the trainer uses the sampler's experts, only the
# numerics differ); R2 leaves it as it is, since at θ_old the live routes *are* the
# recorded ones. Both replays keep θ on fixed experts (R2: θ_old's, R3: μ's), so the
# staleness factor no longer contains expert flips caused by the parameter change.
#
# **R3+w** (`rl.replay_weights`, an extension beyond the paper, whose replay is
# index-only) also replays the sampler's recorded combine weights, held fixed, so the
# part of the engine factor that came from the two engines' gate weights on the same
# experts goes too. The price: the router gets no gradient through the combine. It is
# measured on the FP8 rollout and on a rollout whose only difference from the trainer is
# in its gate: exact numerics plus router-logit noise (`sampling.router_noise_std`).

# %%
rewards = jnp.zeros((B,))  # the advantages play no part here
logprobs = jax.jit(policy_logprobs, static_argnames=("cfg",))
eq5_factors = jax.jit(diagnostics.eq5_factors)
routing_mismatch = jax.jit(diagnostics.routing_mismatch)
rng = np.random.default_rng(3)
theta = jax.tree.map(lambda p: p + 0.002 * rng.standard_normal(p.shape, np.float32), params)

MODES = {"none": {"replay": "none"}, "r2": {"replay": "r2"}, "r3": {"replay": "r3"},
         "r3+w": {"replay": "r3", "replay_weights": True}}


def eq5_by_mode(rollout_, label):
    """Eq. 5 factors and θ's expert moves of one rollout under each replay mode."""
    eq5, route_shift = {}, {}
    for mode, rl in MODES.items():
        run = ExperimentConfig(model=cfg, sampling=sampling,
                               rl=RLConfig(prompts_per_step=B // 2, group_size=2, **rl))
        b, _ = jax.jit(step_fns.score, static_argnames="cfg")(params, rollout_, rewards, cfg=run)
        # The experts π_old used (the score step routes live except under R3).
        replayed = rl["replay"] == "r3"
        _, _, old_aux = logprobs(params, b.tokens_BxS, b.attn_BxS, cfg,
                                 replay_BxTxLxK=b.replay_BxTxLxK if replayed else None)
        logp_theta, _, aux = logprobs(theta, b.tokens_BxS, b.attn_BxS, cfg,
                                      replay_BxTxLxK=b.replay_BxTxLxK,
                                      replay_weights_BxTxLxK=b.replay_weights_BxTxLxK)
        eq5[mode] = diagnostics.reduce_metrics([eq5_factors(
            logp_theta, b.old_logp_BxT, b.rollout_logp_BxT, b.mask_BxT)])
        # Experts θ uses vs those π_old used, on completion tokens.
        route_shift[mode] = float(routing_mismatch(
            aux["routes"], old_aux["routes"], b.mask_BxT)["any_flip"])
        print(f"{label:12s} replay={mode:5s} spread of log factor: engine "
              f"{eq5[mode]['eq5/engine_log_std']:.3e}  staleness "
              f"{eq5[mode]['eq5/staleness_log_std']:.3e}   tokens whose experts moved "
              f"θ_old → θ: {route_shift[mode]:.3f}")
    return eq5, route_shift


eq5, route_shift = eq5_by_mode(rollouts["fp8"], "fp8")
noisy = rollout.sample(params, prompts, prompt_mask, jax.random.key(2), cfg, sampling,
                       nx.numerics_preset("exact", router_noise_std=0.5, noise_seed=0), eos_id=EOS,
                       pad_id=PAD)
eq5_noisy, _ = eq5_by_mode(noisy, "router noise")

# %%
modes = tuple(MODES)
colors = ["C0", "C1", "C2", "C3"]
fig, axes = plt.subplots(1, 3, figsize=(12, 3))
for ax, key in zip(axes, ("engine", "staleness")):
    ax.bar(modes, [eq5[m][f"eq5/{key}_log_std"] for m in modes], color=colors)
    ratio = "π_old/μ_old" if key == "engine" else "π_θ/π_old"
    ax.set_title(f"{key} factor: std of log {ratio}", fontsize=9)
axes[2].bar(modes, [route_shift[m] for m in modes], color=colors)
axes[2].set_title("tokens whose experts moved θ_old → θ", fontsize=9)
fig.suptitle("FP8 rollout, by replay mode", fontsize=10)
fig.tight_layout()
plt.show()

# R2 at θ_old is live routing: the same engine factor as no replay, computed by a
# separate score pass. R3 replays μ's experts: a smaller one.
assert eq5["r2"]["eq5/engine_log_std"] == eq5["none"]["eq5/engine_log_std"]
assert eq5["r3"]["eq5/engine_log_std"] < eq5["none"]["eq5/engine_log_std"]
# Weight replay: under FP8 the engines' gate weights on the same experts differ little,
# and the engine factor barely moves (the rest of the network's FP8 rounding dominates);
# when the engines differ only in their gate (router noise), replaying the experts
# leaves most of the factor and replaying the weights too removes nearly all of it.
noisy_std = {m: eq5_noisy[m]["eq5/engine_log_std"] for m in MODES}
assert noisy_std["r3+w"] < 0.1 * noisy_std["r3"] < noisy_std["r3"] < noisy_std["none"]
# Replay pins the experts: under R2 θ routes exactly as θ_old did.
assert route_shift["r2"] == 0 < route_shift["none"]
print("replay=r3 shrinks the engine factor; r3+w removes the gate's share; replay=r2 pins "
      "θ_old's experts")

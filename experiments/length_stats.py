"""The training–inference mismatch of a cold start, per token and per response, by router
noise: what the on-policy experiments' mismatch knob does at a given response length.

    python -m experiments.length_stats [--preset tiny|long] [--workdir DIR]
        [--noise 0,0.3,1.0] [--batches 4] [key=value ...]

For each router-noise level σ (sampling.router_noise_std, on top of the FP8 sampler) it
draws `--batches` rollout batches of the preset's on-policy step (rl.prompts_per_step ×
rl.group_size train prompts, the same prompts at every σ) from the SFT cold start, and
prints one table row: the per-token KL k1 and k3 of μ (sampler) from π (trainer), the
response length, the cold start's reward, and the per-response sequence log-ratio
s = Σ_t log π/μ (the log of the sequence IS weight π(y)/μ(y)): its mean, its standard
deviation and the share of responses with π(y)/μ(y) > loss.tis_cap. These are the
trainer's own monitors (`diagnostics.train_infer_mismatch`, live routing, no replay).
The cold start is trained once and cached in the workdir, the one the preset's on-policy
experiment uses by default, so both share it.
"""
from __future__ import annotations

import argparse

import jax
import numpy as np

from experiments import onpolicy, runner
from experiments.cli_errors import one_line_errors
from stablerl_jax import distributed
from stablerl_jax.config import apply_overrides
from stablerl_jax.method.diagnostics import reduce_metrics
from stablerl_jax.method.mismatch import mismatch_pairs
from stablerl_jax.rl.engine import Engine

BASES = {"tiny": onpolicy.tiny_base, "long": onpolicy.long_base}
WORKDIRS = {"tiny": "runs/onpolicy", "long": "runs/onpolicy_long"}


def measure(cfg, data, params, batches: int) -> dict:
    """One row: the reduced monitors over `batches` rollout batches of `cfg` at θ = params."""
    engine = Engine.create(cfg, eos_id=data.tokenizer.eos_id, pad_id=data.tokenizer.pad_id,
                           stop_ids=data.tokenizer.stop_ids)
    state = engine.init_state(params)
    rl, pairs, rewards, lengths = cfg.rl, [], [], []
    for b in range(batches):
        idx = data.train_indices(b, rl.prompts_per_step, rl.seed)
        tokens, mask, answers = data.prompt_batch([data.train[i] for i in idx], rl.group_size)
        rollout = engine.sample(state.params, tokens, mask,
                                jax.random.fold_in(jax.random.key(rl.seed), b))
        rewards.append(data.reward(rollout, answers))
        lengths.append(distributed.host(rollout.completion_mask_BxS).sum(-1))
        pairs.append(jax.tree.map(distributed.host, mismatch_pairs(
            state.params, rollout, cfg.model, temperature=cfg.sampling.temperature,
            impl=rl.logprob_impl)))
    r = {k: float(np.asarray(v)) for k, v in reduce_metrics(pairs).items()
         if np.ndim(v) == 0}
    s_mean = r["seq/log_ratio"]
    return {"k1": r["kl/train_infer_k1"], "k3": r["kl/train_infer_k3"],
            "length": float(np.mean(np.concatenate(lengths))),
            "reward": float(np.mean(np.concatenate(rewards))),
            "s_mean": s_mean, "s_sd": float(np.sqrt(max(r["seq/log_ratio_sq"] - s_mean**2, 0))),
            "beyond_cap": r["seq/beyond_cap"],
            "k1_per_response": r["kl/train_infer_k1"] * float(np.mean(np.concatenate(lengths)))}


@one_line_errors
def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="long", choices=sorted(BASES))
    ap.add_argument("--workdir", default=None, help="default: the on-policy experiment's")
    ap.add_argument("--noise", default="0,0.3,1.0", help="router-noise levels σ, comma-separated")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("overrides", nargs="*", help="section.field=value")
    args = ap.parse_args(argv)
    base = apply_overrides(BASES[args.preset](), args.overrides)
    data, params = runner.task_and_cold_start(base, args.workdir or WORKDIRS[args.preset],
                                     progress=True)
    rows = []
    print(f"\n{args.preset}: {base.rl.prompts_per_step} prompts × {base.rl.group_size} "
          f"responses × {args.batches} batches, numerics={base.sampling.numerics}, "
          f"tis_cap={base.loss.tis_cap}\n")
    print("| σ | KL k1 per token | KL k3 per token | mean length | k1 × length | reward | "
          "E[s] | sd[s] | share π(y)/μ(y) > cap |\n|---|---|---|---|---|---|---|---|---|")
    for sigma in (float(x) for x in args.noise.split(",")):
        cfg = apply_overrides(base, [f"sampling.router_noise_std={sigma}"])
        row = {"noise": sigma, **measure(cfg, data, params, args.batches)}
        rows.append(row)
        print(f"| {sigma:g} | {row['k1']:.2e} | {row['k3']:.2e} | {row['length']:.1f} | "
              f"{row['k1_per_response']:.3f} | {row['reward']:.3f} | {row['s_mean']:.3f} | "
              f"{row['s_sd']:.3f} | {row['beyond_cap']:.3f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()

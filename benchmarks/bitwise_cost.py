"""What zero mismatch costs: the global step's hops with the `bitwise` sampler (and the
per-token trainer it implies) against `exact`, measured side by side in one process.

    python -m benchmarks.bitwise_cost [--steps 10] [--coldstarts DIR]
        [--only onpolicy,onpolicy-long] [key=value ...]

For each setting of benchmarks/global_step.py it runs `hop_times` (the median of each hop
over the last `--steps` global steps, from the same cold start) under
`sampling.numerics=exact` and under `sampling.numerics=bitwise`, in that order, and
prints one table: the milliseconds of each hop under both and their ratio (bitwise /
exact). The overrides apply to both (e.g. model.compute_dtype=bfloat16).

    python -m benchmarks.bitwise_cost --model-only [--preset tiny] [--rows 128]
        [--prompt-len 16] [--new-tokens 48] [--steps 10] [key=value ...]

times the model's three hops alone on random weights and prompts (no data set, no
tokenizer: what a machine without the data stack can run): the sampler (`rollout.sample`,
every row decoding --new-tokens tokens), the score forward (`policy_logprobs`) and an
update's forward and backward (the gradient of the summed log-probs) under both arms,
the median of --steps calls after one warm-up, the arms' calls alternating.

    python -m benchmarks.bitwise_cost --forward-split [--preset tiny] [--rows 128]
        [--prompt-len 16] [--new-tokens 48] [--steps 10] [key=value ...]

splits the tiled forward's cost: the model's forward alone (transformer.forward, values
only) on random weights and tokens of --prompt-len + --new-tokens, untiled against tiled,
then the per-token attention of one layer alone (`invariant.attend` on random queries,
keys and values of that shape), in the same process.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import phase
from stablerl_jax import presets
from stablerl_jax.config import apply_overrides
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.runs import compile_cache
from stablerl_jax.sampling import rollout as ro

ARMS = ("exact", "bitwise")


def model_hops(cfg, rows: int, prompt_len: int, new_tokens: int) -> dict:
    """{hop: call} of the sampler, the score forward and the update's gradient for
    ExperimentConfig `cfg` on random weights and prompts (each call waits for its
    result)."""
    model = cfg.model
    sampling = dataclasses.replace(cfg.sampling, max_new_tokens=new_tokens, max_batch=0,
                                   continuous=False)
    numerics = nx.of_sampling(sampling, 0)
    params = tf.init_params(jax.random.key(0), model)
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(0, model.vocab_size, (rows, prompt_len)), jnp.int32)
    pmask = jnp.ones((rows, prompt_len), bool)
    sample = lambda: ro.sample(params, prompts, pmask, jax.random.key(1), model, sampling,
                               numerics, eos_id=-1, pad_id=0)
    r = sample()
    attn = r.prompt_mask_BxS | r.completion_mask_BxS
    score = jax.jit(lambda p: policy_logprobs(p, r.tokens_BxS, attn, model,
                                              temperature=sampling.temperature)[0])
    grad = jax.jit(jax.grad(lambda p: jnp.sum(policy_logprobs(
        p, r.tokens_BxS, attn, model, temperature=sampling.temperature)[0])))
    return {hop: (lambda fn=fn: jax.block_until_ready(fn())) for hop, fn in (
        ("sample", sample), ("score", lambda: score(params)),
        ("update (forward + backward)", lambda: grad(params)))}


def forward_split(cfg, rows: int, tokens: int) -> dict:
    """({arm: {"forward": call}}, call): the forward (exact: untiled, bitwise: tiled) on
    random weights and tokens, and one layer's `invariant.attend` at that shape."""
    from stablerl_jax.model import invariant

    model = cfg.model
    params = tf.init_params(jax.random.key(0), model)
    toks = jax.random.randint(jax.random.key(1), (rows, tokens), 0, model.vocab_size)
    dt = jnp.dtype(model.compute_dtype)
    n, h, kv, dh = rows * tokens, model.num_heads, model.num_kv_heads, model.head_dim
    r = lambda i, shape: jax.random.normal(jax.random.key(i), shape, dt)
    q, k, v = r(2, (n, h, dh)), r(3, (rows, tokens, kv, dh)), r(4, (rows, tokens, kv, dh))
    pos = jnp.tile(jnp.arange(tokens, dtype=jnp.int32), rows)
    row = jnp.repeat(jnp.arange(rows, dtype=jnp.int32), tokens)
    start, mask = jnp.zeros(n, jnp.int32), jnp.ones((rows, tokens), bool)
    attend = jax.jit(lambda *a: invariant.attend(*a, kv_heads=kv, dtype=dt,
                                                 tile=model.row_tile))
    calls = {}
    for arm, tiled in (("exact", False), ("bitwise", True)):
        m = dataclasses.replace(model, batch_invariant=tiled)
        fwd = jax.jit(lambda p, t, m=m: tf.forward(p, t, m)[0])
        calls[arm] = {"forward": lambda fwd=fwd: jax.block_until_ready(fwd(params, toks))}
    return calls, lambda: jax.block_until_ready(attend(q, pos, row, start, k, v, mask))


def interleaved(calls: dict, steps: int) -> dict:
    """{arm: {hop: median seconds}} of `calls` ({arm: {hop: call}}): per hop, one warm-up
    call of each arm, then `steps` rounds of one call of each arm in turn, so that a
    drift in the machine's speed falls on both arms alike."""
    times = {arm: {} for arm in calls}
    for hop in next(iter(calls.values())):
        phase(f"{hop}: a warm-up call of each arm, then {steps} timed rounds")
        for arm in calls:
            calls[arm][hop]()
        for _ in range(steps):
            for arm in calls:
                t0 = time.perf_counter()
                calls[arm][hop]()
                times[arm].setdefault(hop, []).append(time.perf_counter() - t0)
    out = {arm: {hop: float(np.median(t)) for hop, t in by_hop.items()}
           for arm, by_hop in times.items()}
    for by_hop in out.values():
        by_hop["sum"] = sum(by_hop.values())
    return out


def _table(title: str, hops: dict) -> None:
    print(f"\n{title}\n")
    print("| hop | exact ms | bitwise ms | bitwise / exact |\n|---|---|---|---|")
    for hop, exact in hops["exact"].items():
        exact = exact[1] if isinstance(exact, tuple) else exact
        bitwise = hops["bitwise"][hop]
        bitwise = bitwise[1] if isinstance(bitwise, tuple) else bitwise
        print(f"| {hop} | {exact * 1e3:.1f} | {bitwise * 1e3:.1f} | {bitwise / exact:.2f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--coldstarts", default="",
                    help="where cold starts are kept and reused (default: "
                         "$STABLERL_COLDSTARTS or ~/.cache/stablerl_jax/coldstarts)")
    ap.add_argument("--only", default="onpolicy")
    ap.add_argument("--cache", default="", help="persistent compilation cache directory")
    ap.add_argument("--model-only", action="store_true",
                    help="time the model's hops on random weights (no data)")
    ap.add_argument("--forward-split", action="store_true",
                    help="time the forward alone and the per-token attention within it")
    ap.add_argument("--preset", default="tiny",
                    help="the preset of --model-only and --forward-split")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("overrides", nargs="*", help="section.field=value, applied to both arms")
    args = ap.parse_args(argv)
    compile_cache.enable(args.cache)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPU cores")
    if args.forward_split:
        cfg = presets.preset(args.preset, ["mesh=1,1,1", "mesh_dcn=1,1,1", *args.overrides])
        tokens = args.prompt_len + args.new_tokens
        calls, attend = forward_split(cfg, args.rows, tokens)
        t = interleaved(calls, args.steps)
        fwd = t["bitwise"]["forward"]
        att = interleaved({"bitwise": {"attend": attend}}, args.steps)["bitwise"]["attend"]
        for by_hop in t.values():
            by_hop.pop("sum")
        _table(f"{args.preset} model, forward alone: compute {cfg.model.compute_dtype}, "
               f"{args.rows} rows of {tokens} tokens, median of {args.steps} calls", t)
        print(f"\n`invariant.attend`, one layer: {att * 1e3:.1f} ms; "
              f"× {cfg.model.num_layers} layers = {cfg.model.num_layers * att / fwd:.0%} "
              "of the tiled forward")
        return
    if args.model_only:
        base = presets.preset(args.preset, ["mesh=1,1,1", "mesh_dcn=1,1,1", *args.overrides])
        phase("each arm's sampler: a first call (compiles), whose rollout the other hops score")
        hops = interleaved({arm: model_hops(apply_overrides(base, [f"sampling.numerics={arm}"]),
                                            args.rows, args.prompt_len, args.new_tokens)
                            for arm in ARMS}, args.steps)
        _table(f"{args.preset} model: compute {base.model.compute_dtype}, {args.rows} rows "
               f"of {args.prompt_len} + {args.new_tokens} tokens, median of {args.steps} "
               "calls", hops)
        return
    from benchmarks.global_step import SETTINGS, hop_times  # (the data stack)
    from experiments import runner
    for name in args.only.split(","):
        base = apply_overrides(SETTINGS[name](), [f"rl.steps={args.steps}", *args.overrides])
        phase(f"{name}: data and cold start")
        data, params = runner.kept_cold_start(base, args.coldstarts)
        hops = {}
        for arm in ARMS:
            phase(f"{name}: sampling.numerics={arm}")
            hops[arm] = hop_times(apply_overrides(base, [f"sampling.numerics={arm}"]), data,
                                  params, args.steps)
        _table(f"{name}: compute {base.model.compute_dtype}, "
               f"{base.rl.prompts_per_step * base.rl.group_size} responses per step, "
               f"median of {args.steps} steps", hops)


if __name__ == "__main__":
    main()

"""Does the sampler compute the trainer's numbers on this machine? One command, before a run:

    python -m experiments.bitwise_check [--preset tiny] [--hf DIR] [--rows 8]
        [--prompt-len 12] [--new-tokens 12] [--seed 0] [key=value ...]

It builds the preset's model (seeded random weights, or a Hugging Face Qwen3-MoE
checkpoint with --hf) with `sampling.numerics=bitwise` unless an override names another
preset, samples --rows rows of random left-padded prompts with the real sampler (no stop
id: every row decodes --new-tokens tokens), and compares:

1. end to end: the sampler's log μ, experts and gate weights against the score step's
   (`policy_logprobs`, the trainer's forward) on every token the sampler processed;
2. layer by layer: the sampler's calls replayed on the sampled tokens (the prefill over
   the prompts, then one cache step per token) against one training forward over the
   whole rows, in the order the computation runs: each layer's residual stream after
   attention, its experts and gate weights, its residual stream after the expert FFN,
   then the log-probs of the drawn tokens.

It prints one line per check; where two engines part, the first layer and op, how many
tokens differ and by how many ulps (units in the last place of the compared dtype). Exit
status 0 only when everything agrees bit for bit, 1 when something differs, 2 for a bad
argument (sizes past MAX_ROWS / MAX_TOKENS, a seed outside [0, 2³¹ − 1], a run out of
memory), 3 for an error of the tool itself (with its traceback). On another preset
(`sampling.numerics=exact`) it shows where the mismatch starts. The model runs on one device unless a `mesh=data,fsdp,expert` override names a
mesh of this machine's devices (with `sampling.layout=serve`, the sampler's decode loop
in the serving layout); --rows must then be a multiple of the mesh's devices.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax import presets, sharding
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.sampling import rollout as ro


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a − b| in units in the last place of their float dtype (0 where bitwise equal;
    +0 and −0 are 0 apart)."""
    a, b = np.asarray(a), np.asarray(b)
    bits = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    a = np.where(a == 0, 0, a).astype(a.dtype)
    b = np.where(b == 0, 0, b).astype(b.dtype)

    def ordered(x):
        i = x.view(bits).astype(np.int64)
        return np.where(i < 0, np.iinfo(bits).min - i, i)

    return np.abs(ordered(a) - ordered(b))


def _prompts(rng, rows: int, length: int, vocab: int):
    lens = rng.integers(1, length + 1, rows)
    tokens = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), bool)
    for r, n in enumerate(lens):
        tokens[r, length - n:] = rng.integers(0, vocab, n)
        mask[r, length - n:] = True
    return jnp.asarray(tokens), jnp.asarray(mask)


def _replay(weights, rollout, prompt_len: int, cfg, sampling, numerics, mesh,
            logprob_impl: str):
    """The sampler's own calls on its drawn tokens: (trace [B, S−1, L, D] per op, routes
    and gate weights [B, S−1, L, K], log-probs of the drawn tokens [B, S−1]) by slot."""
    tokens, pmask = rollout.tokens_BxS, rollout.prompt_mask_BxS
    b, s = tokens.shape
    dtype = nx.compute_dtype(numerics, cfg.compute_dtype)
    call = jax.jit(lambda w, t, m, c: tf.forward(w, t, cfg, attention_mask_BxT=m,
                                                 numerics=numerics, cache=c, trace=True,
                                                 mesh=mesh))
    next_lp = jax.jit(lambda w, h: ro.next_logprobs(w, h, cfg, sampling, numerics, mesh,
                                                    logprob_impl=logprob_impl))
    h, aux = call(weights, tokens[:, :prompt_len], pmask[:, :prompt_len],
                  tf.init_cache(cfg, b, s, dtype))
    parts = [(aux["trace"], aux["routes"], aux["route_weights"])]
    lp_V = [next_lp(weights, h[:, -1])]
    cache = aux["cache"]
    for j in range(prompt_len, s - 1):
        h, aux = call(weights, tokens[:, j:j + 1], rollout.completion_mask_BxS[:, j:j + 1],
                      cache)
        cache = aux["cache"]
        parts.append((aux["trace"], aux["routes"], aux["route_weights"]))
        lp_V.append(next_lp(weights, h[:, 0]))
    cat = lambda xs: jnp.concatenate(xs, axis=1)
    trace = {k: cat([p[0][k] for p in parts]) for k in parts[0][0]}
    routes, gates = cat([p[1] for p in parts]), cat([p[2] for p in parts])
    # lp_V[i] is drawn at slot prompt_len + i from the hidden state of the slot before.
    drawn = tokens[:, prompt_len:]
    logp = jnp.stack([jnp.take_along_axis(v, drawn[:, i:i + 1], 1)[:, 0]
                      for i, v in enumerate(lp_V)], axis=1)
    return trace, routes, gates, logp


def _compare(name: str, a, b, where: np.ndarray) -> tuple[bool, str]:
    """One check: (agrees, its line). `where`: [B, S] tokens compared (the leading dims)."""
    a, b = np.asarray(a)[where], np.asarray(b)[where]
    if np.array_equal(a, b):
        return True, f"  {name}: equal on {int(where.sum())} tokens"
    differ = np.any((a != b).reshape(a.shape[0], -1), axis=1)
    rows, slots = np.nonzero(where)
    first = int(np.argmax(differ))
    line = (f"  {name}: {int(differ.sum())} of {int(where.sum())} tokens differ, first at "
            f"row {rows[first]} slot {slots[first]}")
    if jnp.issubdtype(a.dtype, jnp.floating):
        u = ulps(a, b)
        line += f", {int(u[first].max())} ulps there (max {int(u.max())} ulps)"
    return False, line


def check(cfg, params, *, rows: int = 8, prompt_len: int = 12, new_tokens: int = 12,
          seed: int = 0, out=print) -> bool:
    """Run both comparisons (module docstring) for ExperimentConfig `cfg` and `params`;
    print with `out`; True when everything agrees bit for bit."""
    model = cfg.model
    sampling = dataclasses.replace(cfg.sampling, max_new_tokens=new_tokens, max_batch=0,
                                   continuous=False)
    numerics = nx.of_sampling(sampling, seed)
    prompts, pmask = _prompts(np.random.default_rng(seed), rows, prompt_len,
                              model.vocab_size)
    mesh = None
    if np.prod(cfg.mesh) > 1:
        mesh = sharding.config_mesh(cfg.mesh, dcn_shape=cfg.mesh_dcn)
        dp = mesh.size
        if rows % dp:
            raise ValueError(f"--rows={rows} must be a multiple of the mesh's {dp} devices "
                             f"(mesh={','.join(map(str, cfg.mesh))}); change --rows")
        params = jax.device_put(params, sharding.tree_shardings(
            tf.param_logical_axes(model), params, mesh))
    rollout = ro.sample(params, prompts, pmask, jax.random.key(seed), model, sampling,
                        numerics, eos_id=-1, pad_id=0, mesh=mesh,
                        logprob_impl=cfg.rl.logprob_impl)
    attn = rollout.prompt_mask_BxS | rollout.completion_mask_BxS
    logp, _, aux = policy_logprobs(params, rollout.tokens_BxS, attn, model,
                                   temperature=sampling.temperature, trace=True, mesh=mesh,
                                   impl=cfg.rl.logprob_impl)
    per_token = model.batch_invariant
    out(f"bitwise_check: {rows} rows, {prompt_len} prompt + {new_tokens} new tokens, "
        f"compute {model.compute_dtype}, sampler numerics {sampling.numerics!r} "
        f"({'per-token' if per_token else 'not per-token'}), {model.num_layers} layers, "
        f"backend {jax.default_backend()}, "
        + (f"mesh {cfg.mesh}, sampler layout {sampling.layout}" if mesh else "one device"))
    processed = np.asarray(rollout.routes_mu_BxSxLxK[:, :-1, 0, 0] >= 0)
    drawn = np.asarray(rollout.completion_mask_BxS[:, 1:])
    results = [("end to end", [
        _compare("log μ vs log π_old", rollout.logp_mu_BxS[:, 1:], logp, drawn),
        _compare("experts", rollout.routes_mu_BxSxLxK[:, :-1], aux["routes"], processed),
        _compare("gate weights", rollout.route_weights_mu_BxSxLxK[:, :-1],
                 aux["route_weights"], processed)])]
    trace, routes, gates, replay_logp = _replay(nx.prepare_params(params, numerics), rollout,
                                                prompt_len, model, sampling, numerics, mesh,
                                                cfg.rl.logprob_impl)
    train_trace = aux["trace"]
    layered = []
    for layer in range(model.num_layers):
        at = lambda x: x[:, :, layer]
        layered += [
            _compare(f"layer {layer} attention", at(trace["attention"]),
                     at(train_trace["attention"]), processed),
            _compare(f"layer {layer} experts", at(routes), at(aux["routes"]), processed),
            _compare(f"layer {layer} gate weights", at(gates), at(aux["route_weights"]),
                     processed),
            _compare(f"layer {layer} expert FFN", at(trace["block"]), at(train_trace["block"]),
                     processed)]
    layered.append(_compare("log-probs", jnp.pad(replay_logp, ((0, 0), (prompt_len - 1, 0))),
                            logp, drawn))
    results.append(("layer by layer", layered))
    agree = True
    for title, checks in results:
        out(title + ":")
        first_bad = next((line for ok, line in checks if not ok), None)
        for ok, line in checks:
            out(line)
        if first_bad:
            out(f"  first to part: {first_bad.strip()}")
            agree = False
    out("OK: the sampler computes the trainer's numbers bit for bit" if agree else
        "DIFFERENT: the sampler and the trainer part where shown above")
    return agree


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.bitwise_check",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", help=f"one of {sorted(presets.EXPERIMENT_PRESETS)}")
    ap.add_argument("--hf", default="", help="a Hugging Face Qwen3-MoE checkpoint directory")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)
    try:
        check_arguments(args)
        overrides = list(args.overrides)
        if not any(o.startswith("sampling.numerics=") for o in overrides):
            overrides.insert(0, "sampling.numerics=bitwise")
        if not any(o.startswith("mesh=") for o in overrides):
            overrides += ["mesh=1,1,1", "mesh_dcn=1,1,1"]
        cfg = presets.preset(args.preset, overrides)
        if args.hf:
            from stablerl_jax.interop import hf_checkpoint
            cfg = hf_checkpoint.experiment_with_checkpoint(cfg, args.hf)
            params = hf_checkpoint.load_hf_params(args.hf, cfg.model)
        else:
            params = tf.init_params(jax.random.key(args.seed), cfg.model)
        if args.prompt_len + args.new_tokens > cfg.model.max_seq_len:
            raise ValueError(f"--prompt-len + --new-tokens = {args.prompt_len + args.new_tokens}"
                             f" exceeds model.max_seq_len={cfg.model.max_seq_len}; shorten them")
        ok = check(cfg, params, rows=args.rows, prompt_len=args.prompt_len,
                   new_tokens=args.new_tokens, seed=args.seed)
    except MemoryError:
        print(f"bitwise_check: error: --rows {args.rows} × --prompt-len + --new-tokens "
              f"{args.prompt_len + args.new_tokens} does not fit in this machine's memory; "
              "lower --rows", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"bitwise_check: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"bitwise_check: error: the device ran out of memory for --rows {args.rows} "
              f"× {args.prompt_len + args.new_tokens} tokens; lower --rows", file=sys.stderr)
        return 2
    return 0 if ok else 1


MAX_ROWS = 4096  # a check compares a few rows; more only costs memory
MAX_TOKENS = 2**20  # --rows × (--prompt-len + --new-tokens)


def check_arguments(args) -> None:
    """Each size in [1, its bound] and --seed in [0, 2³¹ − 1]: a ValueError (exit 2)
    naming the argument before anything is built."""
    for name, most in (("rows", MAX_ROWS), ("prompt_len", MAX_TOKENS),
                       ("new_tokens", MAX_TOKENS)):
        v = getattr(args, name)
        if not 1 <= v <= most:
            raise ValueError(f"--{name.replace('_', '-')}: must be in [1, {most:,}], got {v}")
    tokens = args.rows * (args.prompt_len + args.new_tokens)
    if tokens > MAX_TOKENS:
        raise ValueError(f"--rows × (--prompt-len + --new-tokens) = {tokens:,} tokens is more "
                         f"than {MAX_TOKENS:,} (MAX_TOKENS: a check compares a few rows); "
                         "lower --rows")
    if not 0 <= args.seed <= 2**31 - 1:
        raise ValueError(f"--seed: must be in [0, 2147483647], got {args.seed}")


def _main() -> int:
    """The command: main(), and status 3 with the traceback for an error of the tool
    itself, so that status 1 always means the engines differ."""
    try:
        return main()
    except Exception:  # noqa: BLE001 (a bug: shown whole, under its own status)
        traceback.print_exc()
        return 3


if __name__ == "__main__":
    sys.exit(_main())

"""Oracles of the AOT tests: an analytic per-chip memory account of the update step, and
the all-gathers of an HLO module that yield every expert of a weight or any weight whole."""
import math
import re

import jax
from flax import traverse_util

from stablerl_jax.config import ExperimentConfig
from stablerl_jax.kernels.fused_logprob_impls import LogprobBlocks
from stablerl_jax.kernels.gmm_impls import padded_rows
from stablerl_jax.model import transformer as tf
from stablerl_jax.pod import hlo_loops


def expert_weight_gathers(hlo_text: str, num_experts: int, ffn_dim: int) -> list[str]:
    """All-gathers in an optimized HLO module whose result holds every one of the E
    experts of an expert weight: a shape of 3 or more dims with both E and the expert FFN
    width F among them. Under expert parallelism there is none (each device gathers its
    own E/n experts' weights over the FSDP axes only)."""
    found = []
    for line in hlo_text.splitlines():
        m = re.search(r"\sall-gather(?:-start)?\(", line)
        if not m:
            continue
        for dims in re.findall(r"\[([\d,]+)\]", line[:m.start()]):
            d = [int(x) for x in dims.split(",") if x]
            if len(d) >= 3 and num_experts in d and ffn_dim in d:
                found.append(line.strip()[:200])
    return found


def update_memory_bound(cfg: ExperimentConfig, engine) -> dict:
    """An analytic per-chip account of the update step (bytes), to check a compiled
    program against:

      state        params + AdamW moments, each leaf's own shard (exact: the Engine's
                   shardings; what the step's arguments must hold)
      grads        the float32 gradient accumulator and one micro-batch's gradient
      batch        one mini-batch's per-chip rows of the TrainBatch
      activations  one micro-batch (t tokens per chip) under full remat: the L layer
                   inputs the scan saves, plus the working set of one layer's backward:
                   its gathered weights, attention (q/k/v/o and one query chunk's
                   [chunk, S] scores per head, three times: scores, probs, gradient), the
                   MoE buffers (R sorted rows of D and 3F in and out, twice for the
                   gradient, plus float32 partial outputs) and the fused log-prob's
                   [t, C] chunk (C: the chunked impl's vocab chunk, LogprobBlocks().chunk);
                   each counted at 4 bytes and twice over for the compiler's double
                   buffering.
    `bound` is their sum. Under remat="none" the activation term is not a bound."""
    mc, rl = cfg.model, cfg.rl
    n_dev = math.prod(cfg.mesh)
    shard = lambda tree, sh: sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                                 for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(sh)))
    params = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), mc))
    p_bytes = shard(params, engine.param_shardings)
    rows = rl.prompts_per_step * rl.group_size // rl.num_minibatches
    s = cfg.task.max_prompt_len + cfg.sampling.max_new_tokens
    t = max(rows // rl.microbatches // n_dev, 1) * (s - 1)
    d, f, h, kv, dh = mc.d_model, mc.expert_ffn_dim, mc.num_heads, mc.num_kv_heads, mc.head_dim
    ep = cfg.mesh[2] if mc.expert_parallel else 1
    e_loc = mc.num_experts // ep
    t_moe = t * ep
    r_rows = padded_rows(t_moe * mc.top_k, e_loc, mc.moe_tile)
    chunk = mc.attention_chunk if mc.attention_impl == "chunked" else s
    layer_w = (e_loc * 3 * d * f + 2 * (h + kv) * dh * d + d * mc.num_experts) * 4
    attention = (t * (2 * h + 2 * kv) * dh + 3 * h * min(chunk, s) * s) * 4
    moe = 2 * r_rows * (2 * d + 3 * f) * 4 + 2 * t_moe * d * 4
    logprob = 3 * t * LogprobBlocks().chunk * 4 + t * d * 4
    activations = 2 * (mc.num_layers * t * d * 4 + layer_w + attention + moe + logprob)
    out = {"state": 3 * p_bytes, "grads": 2 * p_bytes,
           "batch": (rows // n_dev) * s * (4 * 5 + 4 * mc.num_layers * mc.top_k),
           "activations": activations}
    out["bound"] = sum(out.values())
    return out


def weight_shapes(params_like, num_experts: int, expert_shards: int) -> list[tuple]:
    """The shapes a gather of a weight yields, for `param_gathers`: each weight's full
    shape, one layer's slice of a layer-stacked one, and one layer's experts on one of
    `expert_shards` expert shards ([E / shards, ...])."""
    shapes = []
    for leaf in traverse_util.flatten_dict(params_like).values():
        shapes += [tuple(leaf.shape), tuple(leaf.shape[1:])]
        if len(leaf.shape) == 4 and leaf.shape[1] == num_experts:
            shapes.append((num_experts // expert_shards, *leaf.shape[2:]))
    return shapes


def param_gathers(instrs, param_shapes) -> list[str]:
    """All-gathers among `instrs` whose result is a weight: its dims (size-1 dims
    dropped) equal those of one of `param_shapes` (pass each weight's full shape, one
    layer's slice of a layer-stacked one, and any per-device slice that a layout may
    gather, e.g. one expert shard's experts). Shapes are how the weight is recognized:
    an activation of the same dims would count too."""
    want = {tuple(d for d in s if d != 1) for s in param_shapes}
    found = []
    for ins in instrs:
        if ins.collective != "all-gather":
            continue
        for _, dims in hlo_loops.arrays(ins.shape):
            if tuple(d for d in dims if d != 1) in want:
                found.append(f"%{ins.name} = {ins.shape} {ins.opcode}"[:200])
    return found

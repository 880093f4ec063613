"""Step times estimated from compiled TPU programs: compiler / roofline, not measured on a TPU.

Letters: B rows of a sample pass, P prompt slots, C = max_new_tokens, S = P + C, L layers, KV
key/value heads, Dh head width.

A program's time on one chip is estimated as

    max(FLOPs / peak FLOP/s, HBM bytes / HBM bandwidth) + collective bytes / ICI bandwidth
                                                         + DCN bytes / DCN bandwidth

with `CHIP_SPECS`' constants: compute and memory overlap; collectives count as if nothing hid
them (pessimistic about communication). DCN bytes: what a multi-slice program sends between
slices (hlo_loops.py; its collectives stay on ICI); 0 on one slice.

Sources. XLA's cost analysis counts a while-loop body once, and its TPU cost model
(`optimal_seconds`) holds only for a loop-free program, so per-iteration costs come from
programs compiled on their own (sampler_programs.py): a decode step as the decode loop runs it,
whose scanned layer loop XLA counts once, and that step without its layers (the head). A decode
step is head + L × (step − head). (Unrolled-layer differences, the earlier way, are not the
program that runs, nor linear in L: XLA counts 0.90, 1.26 and 1.27 GB for 1, 2 and 3 `paper`
layers.) With model.decode_block a layer's attention loops over the filled key blocks
(⌈(slot+1)/block⌉ trips, unseen by a compiler, counted once): one block is compiled alone, and
the step at slot σ is the step program plus L·(⌈(σ+1)/block⌉ − 1) blocks. A Pallas kernel is
opaque to XLA's count (a custom call's operands count as read whole), so the step program
attends by the reference blocks, except the per-token kernel of batch-invariant numerics, which
declares what it reads and computes (decode_attention_pallas.token_cost): one block per query in
the step program, its per-block difference as the block. A step's collective bytes come from its
optimized HLO, loops at their trip counts (stablerl_jax/pod/hlo_loops.py). Score and update:
model FLOPs (model/flops.py, plus the update's rematerialized forward) and collective bytes; HBM
traffic not modeled (33k-token micro-batches are compute bound).

The fixed-length estimate runs every row for all C decode steps; schedule_prices.py prices the
sampler's schedules at given response lengths with these per-step costs."""
from __future__ import annotations

import dataclasses
import math

from stablerl_jax import sharding
from stablerl_jax.config import ExperimentConfig
from stablerl_jax.model.flops import forward_flops
from stablerl_jax.pod import hlo_loops
from stablerl_jax.pod.sampler_programs import (
    decode_block_program,
    decode_step_program,
    head_program,
    rows_per_pass,
    token_block_cost,
    token_kernel,
)
from stablerl_jax import packing


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    peak_flops: float   # bf16 FLOP/s per chip
    hbm_bw: float       # HBM bytes/s per chip
    ici_bw: float       # inter-chip interconnect bytes/s per chip (one direction)
    source: str
    dcn_bw: float = math.nan  # data-center network bytes/s per chip (between slices)


# Per chip, from the Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/<v>).
# ICI: the stated per-chip interconnect bandwidth in Gbps / 8; v4's page states none, so
# its all-reduce bandwidth per pod (1.1 PB/s) is divided by the pod's 4,096 chips.
# DCN: v5p's page states "Data center network (DCN) bandwidth per chip: 50 Gbps"; v5e's
# states 2 x 100 Gbps NICs per 8-chip host (and 6.4 Tbps per 256-chip pod): 25 Gbps a
# chip. The v6e and v4 pages state no DCN bandwidth: NaN, so a multi-slice estimate on
# them reads nan rather than an invented number.
CHIP_SPECS = {
    "v5p": ChipSpec(459e12, 2765e9, 4800e9 / 8,
                    "tpu/docs/v5p: 459 TFLOP/s bf16, 2,765 GB/s HBM, ICI 4,800 Gbps, "
                    "DCN 50 Gbps", dcn_bw=50e9 / 8),
    "v5e": ChipSpec(197e12, 819e9, 1600e9 / 8,
                    "tpu/docs/v5e: 197 TFLOP/s bf16, 819 GB/s HBM, ICI 1,600 Gbps, "
                    "DCN 2 x 100 Gbps per 8 chips", dcn_bw=25e9 / 8),
    "v6e": ChipSpec(918e12, 1640e9, 3584e9 / 8,
                    "tpu/docs/v6e: 918 TFLOP/s bf16, 1,640 GB/s HBM, ICI 3,584 Gbps"),
    "v4": ChipSpec(275e12, 1200e9, 1.1e15 / 4096,
                   "tpu/docs/v4: 275 TFLOP/s bf16, 1,200 GB/s HBM, all-reduce 1.1 PB/s "
                   "per 4,096-chip pod"),
    # NVIDIA's H100 SXM and H200 datasheets: dense bf16 (the sheets' 1,979 TFLOP/s is
    # with 2:4 sparsity), HBM bandwidth, NVLink 900 GB/s in both directions together.
    "h100": ChipSpec(989e12, 3350e9, 900e9 / 2,
                     "H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink "
                     "900 GB/s"),
    "h200": ChipSpec(989e12, 4800e9, 900e9 / 2,
                     "H200 datasheet: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, NVLink 900 GB/s"),
}


def chip_of(topology_name: str) -> ChipSpec:
    """The chip of a topology name (`v5p-256`, or `2xv5p-128` for two slices)."""
    return CHIP_SPECS[topology_name.split("x", 1)[-1].split("-")[0]]


@dataclasses.dataclass
class Cost:
    """One chip's work in one program run (or one loop iteration)."""

    flops: float
    hbm_bytes: float
    collective_bytes: float  # over ICI (inside a slice)
    optimal_seconds: float = math.nan  # XLA's TPU cost model, loop-free programs only
    dcn_bytes: float = 0.0   # between slices

    def seconds(self, chip: ChipSpec) -> float:
        """The roofline estimate (module docstring)."""
        return (max(self.flops / chip.peak_flops, self.hbm_bytes / chip.hbm_bw)
                + self.collective_bytes / chip.ici_bw + dcn_seconds(self.dcn_bytes, chip))

    def __add__(self, o: "Cost") -> "Cost":
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self),
                                            dataclasses.astuple(o))))

    def scale(self, k: float) -> "Cost":
        return Cost(*(k * a for a in dataclasses.astuple(self)))


def dcn_seconds(dcn_bytes: float, chip: ChipSpec) -> float:
    """DCN bytes at the chip's DCN bandwidth; no bytes is 0 s even where it is unstated (NaN)."""
    return dcn_bytes / chip.dcn_bw if dcn_bytes else 0.0


def of_compiled(compiled, slices: tuple = ()) -> Cost:
    """Cost of a compiled program: XLA's FLOPs, bytes accessed and optimal_seconds, its HLO's
    ICI and DCN bytes (loops at trip counts; `slices`: sharding.slice_indices of its mesh)."""
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    module = hlo_loops.Module(compiled.as_text())
    net = module.network_bytes(module.entry, slices=slices)
    return Cost(float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)),
                net["ici"], float(cost.get("optimal_seconds", math.nan)), net["dcn"])


def decode_step_cost(engine) -> tuple[Cost, Cost, Cost]:
    """(one layer, one decode step of all L layers, its head): the sampler's step program less
    its head (head_program) is its layers, one if scanned (XLA counts a loop body once), L if
    unrolled. optimal_seconds is kept for the loop-free head only."""
    layers = engine.cfg.model.num_layers
    slices = sharding.slice_indices(engine.mesh)
    step, head = (of_compiled(fn.lower(*args).compile(), slices)
                  for fn, args in (decode_step_program(engine), head_program(engine)))
    per = 1 if not engine.cfg.model.unroll_layers else layers
    layer = dataclasses.replace((step + head.scale(-1)).scale(1 / per),
                                optimal_seconds=math.nan)
    return layer, head + layer.scale(layers), head


def decode_step_costs(engine, slots: int) -> tuple[Cost, Cost, Cost | None, Cost]:
    """(one layer, one decode step at its first slot, one key block or None, the head): the
    programs of the module docstring; `slots`: the first decode slot (P)."""
    layer, step, head = decode_step_cost(engine)
    blk = engine.cfg.model.decode_block
    if not blk:
        return layer, step, None, head
    if token_kernel(engine):  # the per-token kernel's declared cost of a block
        cost = token_block_cost(engine)
        block = Cost(cost["flops"], cost["bytes accessed"], 0.0)
    else:
        fn, args = decode_block_program(engine)
        block = of_compiled(fn.lower(*args).compile(), sharding.slice_indices(engine.mesh))
    blocks = slots // blk + 1
    return (layer, step + block.scale(engine.cfg.model.num_layers * (blocks - 1)), block,
            head)


@dataclasses.dataclass
class StepEstimate:
    step: str
    seconds: float
    detail: str


def extra_blocks(first_slot: int, steps: int, block: int) -> dict:
    """{key blocks beyond the first decode step's: decode steps}: step i writes slot
    first_slot+i and reads ⌈(slot + 1) / block⌉ blocks of each layer's cache (the "blocks"
    decode attention); block 0 (the whole cache every step): {0: steps}."""
    counts = {}
    for i in range(steps):
        extra = (first_slot + i) // block - first_slot // block if block else 0
        counts[extra] = counts.get(extra, 0) + 1
    return counts


@dataclasses.dataclass
class SamplerCosts:
    """One chip's sampler-program costs: the first decode step (at slot P, with the loop's
    per-step collectives), one layer, one key block (None without model.decode_block), the head,
    and a sample step's collective bytes outside the decode loop (ICI; DCN between slices)."""

    first: Cost
    layer: Cost
    block: Cost | None
    head: Cost
    once_collective_bytes: float
    once_dcn_bytes: float = 0.0


def sampler_costs(engine, sample_hlo: str) -> SamplerCosts:
    """The decode programs compiled (decode_step_costs) and the compiled sample step's
    collectives, per decode step and outside the decode loop."""
    module = hlo_loops.Module(sample_hlo)
    loop = hlo_loops.decode_loop(module)
    trips = step_trips(engine.cfg, "sample", module)
    slices = sharding.slice_indices(engine.mesh)
    per_step = module.network_bytes(loop.body, trips, slices)
    if loop.condition:  # the loop's "every row done?" check runs once per decode step
        cond = module.network_bytes(loop.condition, trips, slices)
        per_step = {k: per_step[k] + cond[k] for k in per_step}
    once = module.network_bytes(module.entry, {**trips, loop.name: 0}, slices)
    layer, first, block, head = decode_step_costs(engine, engine.cfg.task.max_prompt_len)
    # The loop's own collectives (the compiled sample step) replace the program's.
    first = dataclasses.replace(first, collective_bytes=per_step["ici"],
                                dcn_bytes=per_step["dcn"])
    return SamplerCosts(first, layer, block, head, once["ici"], once["dcn"])


def sample_estimate(engine, sample_hlo: str, chip: ChipSpec, costs: SamplerCosts = None):
    """(StepEstimate of a sample step, first-decode-step Cost, one-layer Cost, seconds per pass,
    mean-decode-step Cost, head Cost). Time = passes × Σ over the C decode steps (each at its
    own slot: module docstring) + what runs once (prefill at the chip's peak, collectives
    outside the decode loop). `costs`: sampler_costs, compiled here if None."""
    cfg = engine.cfg
    b = cfg.rl.prompts_per_step * cfg.rl.group_size
    passes = b // rows_per_pass(cfg)
    sc = costs or sampler_costs(engine, sample_hlo)
    first, layer, block, head = sc.first, sc.layer, sc.block, sc.head
    p, n = cfg.task.max_prompt_len, cfg.sampling.max_new_tokens
    blk, num_layers = cfg.model.decode_block, cfg.model.num_layers
    counts = extra_blocks(p, n, blk)
    at = lambda extra: first + block.scale(num_layers * extra) if extra else first
    decode_s = sum(c * at(e).seconds(chip) for e, c in counts.items())
    mean = sum((at(e).scale(c / n) for e, c in counts.items()), Cost(0.0, 0.0, 0.0))
    chips = engine.mesh.size
    prefill_s = forward_flops(cfg.model, b, p) / chips / chip.peak_flops
    once_s = (prefill_s + sc.once_collective_bytes / chip.ici_bw
              + dcn_seconds(sc.once_dcn_bytes, chip))
    total = passes * decode_s + once_s
    detail = (f"{passes} pass(es) × {n} decode steps × {decode_s / n * 1e3:.2f} ms on "
              f"average + prefill and reshard {once_s:.1f} s")
    return StepEstimate("sample", total, detail), first, layer, total / passes, mean, head


def step_trips(cfg: ExperimentConfig, name: str, module: hlo_loops.Module) -> dict:
    """{loop: trip count} for loops of Engine step `name`'s program without an XLA trip count,
    by the function that made them (hlo_loops.trips_by_function): layer scans (L), the sampler's
    passes, score's and update's micro-batch and slice loops (packing.py's scans at capacity).
    The decode loop is the caller's; other programs (kernels) get none."""
    rl = cfg.rl
    loops = {"forward": cfg.model.num_layers}
    if name == "sample":
        loops["map_slices"] = rl.prompts_per_step * rl.group_size // rows_per_pass(cfg)
    elif name in ("score", "update"):
        loops.update(map_slices=rl.num_minibatches * rl.microbatches,
                     value_and_grad=rl.microbatches)
        if rl.pack_tokens:
            b = rl.prompts_per_step * rl.group_size // (rl.num_minibatches
                                                        if name == "update" else 1)
            count = packing.micro_batches(b, math.prod(cfg.mesh), rl.pack_rows)[1]
            loops.update(packed_value_and_grad=count, map_micro_batches=count)
    elif name == "sft_update":
        loops["value_and_grad"] = cfg.sft.microbatches
    else:
        return {}
    return hlo_loops.trips_by_function(module, loops)


def step_network_bytes(cfg: ExperimentConfig, name: str, hlo: str,
                       slices: tuple = ()) -> dict:
    """{"ici", "dcn"} bytes per chip of one call of step `name` (or a kernel) from its HLO,
    loops at trip counts (step_trips), the decode loop at all C steps: the fixed-length bound."""
    module = hlo_loops.Module(hlo)
    trips = step_trips(cfg, name, module)
    if name == "sample":
        trips[hlo_loops.decode_loop(module).name] = cfg.sampling.max_new_tokens
    return module.network_bytes(module.entry, trips, slices)


def train_step_estimate(cfg: ExperimentConfig, name: str, hlo: str, model_flops: float,
                        chip: ChipSpec, slices: tuple = ()) -> StepEstimate:
    """Score / update: model FLOPs at the chip's peak (the update's rematerialized forward
    added: + 1/3 of forward + backward) plus every collective (loops at their trip counts) over
    ICI and, between slices, DCN (`slices`: sharding.slice_indices of its mesh)."""
    flops = model_flops * (4 / 3 if name == "update" and cfg.model.remat == "full" else 1)
    net = step_network_bytes(cfg, name, hlo, slices)
    ici_s, dcn_s = net["ici"] / chip.ici_bw, dcn_seconds(net["dcn"], chip)
    detail = (f"{flops / 1e12:.0f} TFLOP at peak {_s(flops / chip.peak_flops)} + "
              f"collectives {_gib(net['ici'])} {_s(ici_s)}")
    if net["dcn"]:
        detail += f" + DCN {_gib(net['dcn'])} {_s(dcn_s)}"
    return StepEstimate(name, flops / chip.peak_flops + ici_s + dcn_s, detail)


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 0.1 else f"{seconds * 1e3:.2f} ms"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 / 10 else f"{nbytes / 2**20:.2f} MiB"


@dataclasses.dataclass
class Estimates:
    """The roofline estimates of an Engine's compiled steps on one chip (`estimate`)."""

    steps: dict                        # {step: StepEstimate} of sample, score, update
    pass_seconds: float = math.nan     # one sampler pass (the evaluation's unit)
    sampler: SamplerCosts | None = None
    decode: tuple = ()                 # Costs of (the first, the mean decode step,
    #                                    one layer, the head) of a sampler step


def estimate(engine, compiled: dict, chip: ChipSpec) -> Estimates:
    """Estimates on `chip` of `compiled`'s steps ({name: aot.Compiled} of sample/score/update)
    for experiments.aot_compile, runs' `est/…` (rl/costs.py); compiles decode programs."""
    out = Estimates({})
    if "sample" in compiled:
        out.sampler = sampler_costs(engine, compiled["sample"].hlo)
        est, first, layer, out.pass_seconds, mean, head = sample_estimate(
            engine, compiled["sample"].hlo, chip, out.sampler)
        out.steps["sample"], out.decode = est, (first, mean, layer, head)
    for name in ("score", "update"):
        if name in compiled:
            c = compiled[name]
            out.steps[name] = train_step_estimate(engine.cfg, name, c.hlo, c.model_flops,
                                                  chip, c.slices)
    return out


# Achievable model-FLOP utilization of MoE training, published per chip family: MaxText's
# model tiering table (docs/reference/models/tiering.md), Mixtral 8x7B pre-training in
# bf16 at sequence length 4,096 on 256 chips.
PUBLISHED_MFU = {
    "v5p": (0.5256, "MaxText model tiering: Mixtral 8x7B on v5p-256, bf16, SL 4096: 52.56 %"),
    "v6e": (0.3523, "MaxText model tiering: Mixtral 8x7B on v6e-256, bf16, SL 4096: 35.23 %"),
}


def at_mfu(est: dict, compiled: dict, chip: ChipSpec, mfu: float) -> dict:
    """`est` with the FLOP-bound steps (score, update) at model-FLOP utilization `mfu` instead
    of 100 % of peak: model FLOPs / (peak × mfu), never below the roofline estimate (MFU
    includes communication: none added). The memory-bound sampler stays as is."""
    out = dict(est)
    for name in ("score", "update"):
        if name in est and name in compiled:
            c, e = compiled[name], est[name]
            chip_s = c.model_flops / (mfu * chip.peak_flops)
            out[name] = StepEstimate(name, max(e.seconds, chip_s),
                                     f"{c.model_flops / 1e12:.0f} TFLOP at {mfu:.0%} MFU")
    return out


def global_step_estimate(cfg: ExperimentConfig, est: dict,
                         pass_seconds: float) -> tuple[float, dict]:
    """(seconds, by part) of a global step: sample + score + num_minibatches updates +
    evaluation amortized over eval_every steps (eval_problems × eval_k rows in sample passes)."""
    rl = cfg.rl
    eval_passes = -(-rl.eval_problems * rl.eval_k // rows_per_pass(cfg))
    parts = {"sample": est["sample"].seconds, "score": est["score"].seconds,
             "update": rl.num_minibatches * est["update"].seconds,
             "eval (amortized)": eval_passes * pass_seconds / rl.eval_every}
    return sum(parts.values()), parts

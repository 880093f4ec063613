"""The sampler's schedules priced: length-aware estimates of a sample step, the
evaluation and a global step, and a stated model of a separate sampler mesh. Compiler /
roofline estimates, not measurements.

Letters: P prompt slots, C = max_new_tokens, O decode-slot offsets (a write slot is
P + o), R responses of a stream (as in stablerl_jax/pod/sampler_schedules.py).

Given response lengths, the sampler's schedules (stablerl_jax/pod/sampler_schedules.py: static
passes, continuous refilling, partial rollouts) say how many decode steps run and the
largest write slot of each; a step costs the decode step at that slot (roofline.py's
programs: the static sampler's step plus its extra key blocks; with a ragged decode
attention, a `ragged` row of DECODE_IMPLS as model.decode_attention_impl, each row's
own blocks), a prefilled row of P + t tokens its forward FLOPs at the chips' peak, as
the fixed-length prefill. The global step adds a score pass per version of the batch's
tokens (behavior π_old), the updates and the amortized evaluation. `placements` is a
stated model of a separate sampler mesh, scaled from these colocated numbers.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from stablerl_jax import packing
from stablerl_jax.config import ExperimentConfig
from stablerl_jax.kernels.decode_attention_impls import DECODE_IMPLS
from stablerl_jax.model.flops import forward_flops, train_flops
from stablerl_jax.pod import sampler_schedules
from stablerl_jax.pod.roofline import ChipSpec, Cost, SamplerCosts
from stablerl_jax.pod.sampler_programs import rows_per_pass


@dataclasses.dataclass(frozen=True)
class SamplerPrices:
    """Seconds on one chip of the sampler's parts: decode_O[o], a decode step whose
    largest write slot is P + o (o < C: the first step plus L·(extra key blocks) blocks);
    once_s, a sampler call's collectives outside its decode loop; a prefilled row of P +
    t tokens at the chips' peak, as the sample estimate's prefill; `ragged`: the
    sampler's decode attention reads each row's own key blocks."""

    decode_O: np.ndarray
    once_s: float
    model: object   # ModelConfig
    prompt: int     # P
    flops_per_s: float  # chips × peak

    def prefill_s(self, prefills) -> float:
        seq, rows = np.unique(self.prompt + np.asarray(prefills), return_counts=True)
        return sum(forward_flops(self.model, int(r), int(t))
                   for t, r in zip(seq, rows)) / self.flops_per_s

    ragged: bool = False  # the decode attention reads each row's own key blocks

    def seconds(self, s) -> float:
        """One sampler run (a sampler_schedules.Sampling) with the sampler's decode attention:
        `row_reads_seconds` for a ragged one (DECODE_IMPLS' `ragged` rows) where rows
        sit at their own slots, else `max_slot_seconds` (static passes share one slot:
        every row, finished or not, reads up to it)."""
        ragged = self.ragged and not s.shared_slot
        return (self.row_reads_seconds if ragged else self.max_slot_seconds)(s)

    def alt_seconds(self, s) -> float:
        """`seconds` with the other decode attention: the what-if of the other kind."""
        return dataclasses.replace(self, ragged=not self.ragged).seconds(s)

    def max_slot_seconds(self, s) -> float:
        """Its decode steps (each reading every row's key blocks up to the step's largest
        write slot, as the reference "blocks" does), prefills and reshard."""
        return s.runs.sum_of(self.decode_O) + self.prefill_s(s.prefills) + self.once_s

    def row_reads_seconds(self, s) -> float:
        """The same with a decode attention that reads each row's own key blocks (the
        ragged kernel, as paged attention does): each step at its first-slot cost, plus,
        per token written at slot P + o, 1/slots of the extra blocks a step at o reads
        (decode_O[o] − decode_O[0]): a block costs per row what the reference's block
        costs over its rows. A free slot (the continuous sampler's tail) reads only its
        prompt's blocks, which the first-slot cost holds."""
        extra_O = self.decode_O[:len(s.written_O)] - self.decode_O[0]
        return (s.runs.steps * self.decode_O[0] + float(s.written_O @ extra_O) / s.slots
                + self.prefill_s(s.prefills) + self.once_s)


def sampler_prices(cfg: ExperimentConfig, costs: SamplerCosts, chips: int,
                   chip: ChipSpec) -> SamplerPrices:
    p, n, blk = cfg.task.max_prompt_len, cfg.sampling.max_new_tokens, cfg.model.decode_block
    extra_O = (p + np.arange(n)) // blk - p // blk if blk else np.zeros(n, np.int64)
    f, blkc = costs.first, costs.block or Cost(0.0, 0.0, 0.0)
    per = cfg.model.num_layers * extra_O
    decode_O = (np.maximum((f.flops + per * blkc.flops) / chip.peak_flops,
                           (f.hbm_bytes + per * blkc.hbm_bytes) / chip.hbm_bw)
                + (f.collective_bytes + per * blkc.collective_bytes) / chip.ici_bw)
    return SamplerPrices(decode_O, costs.once_collective_bytes / chip.ici_bw, cfg.model, p,
                         chips * chip.peak_flops,
                         DECODE_IMPLS[cfg.model.decode_attention_impl].ragged)


@dataclasses.dataclass
class ScheduleRow:
    """One schedule's global step: per-step means (partial rollouts: over the later half
    of the simulated steps, the steady state). eval_s is amortized (÷ eval_every);
    score_passes: behavior π_old needs one score pass per version in the batch."""

    name: str
    steps: float
    occupancy: float
    sample_s: float
    score_passes: float
    score_s: float
    train_s: float
    eval_steps: int
    eval_occupancy: float
    eval_s: float
    dropped: float = 0.0
    prefill_tokens: float = 0.0
    age_share: tuple = (1.0,)
    age_mean: float = 0.0
    age_max: int = 0
    sample_alt_s: float = math.nan  # SamplerPrices.alt_seconds: the other decode attention
    eval_alt_s: float = math.nan

    @property
    def global_s(self) -> float:
        return self.sample_s + self.score_passes * self.score_s + self.train_s + self.eval_s

    @property
    def global_alt_s(self) -> float:
        return (self.sample_alt_s + self.score_passes * self.score_s + self.train_s
                + self.eval_alt_s)

    @property
    def global_proximal_s(self) -> float:
        """With rl.old_policy=proximal: one score pass, whatever the versions."""
        return self.sample_s + self.score_s + self.train_s + self.eval_s


def schedule_rows(cfg: ExperimentConfig, prices: SamplerPrices, score_s: float,
                  update_s: float, lengths_R: np.ndarray, eval_lengths: np.ndarray,
                  steps: int = 20, staleness=(1, 2)) -> list[ScheduleRow]:
    """Static, continuous and partial rollouts (each S of `staleness`) over the stream
    lengths_R (≥ steps·B + slots responses; static and continuous take its step-sized
    slices), priced by `prices`. Evaluation: static for the static row, else continuous
    (no staleness) over eval_lengths (eval_problems × eval_k rows)."""
    rl = cfg.rl
    b, g = rl.prompts_per_step * rl.group_size, rl.group_size
    slots, train = rows_per_pass(cfg), rl.num_minibatches * update_s
    p = prices.prompt
    evals = {"static": sampler_schedules.static(eval_lengths, slots),
             "continuous": sampler_schedules.continuous(eval_lengths, slots)}
    runs = {name: [fn(lengths_R[k * b:(k + 1) * b], slots) for k in range(steps)]
            for name, fn in (("static", sampler_schedules.static),
                             ("continuous", sampler_schedules.continuous))}
    for s in staleness:
        runs[f"partial S = {s}"] = sampler_schedules.partial(lengths_R, b, g, slots, s,
                                                    steps)[steps // 2:]
    rows = []
    for name, ss in runs.items():
        ev = evals["static" if name == "static" else "continuous"]
        ages = np.zeros(max(len(s.consumed_by_age) for s in ss))
        for s in ss:
            ages[:len(s.consumed_by_age)] += s.consumed_by_age
        mean = lambda f: float(np.mean([f(s) for s in ss]))
        rows.append(ScheduleRow(
            name, mean(lambda s: s.runs.steps), mean(lambda s: s.occupancy),
            mean(prices.seconds), mean(lambda s: np.count_nonzero(s.consumed_by_age)),
            score_s, train, ev.runs.steps, ev.occupancy,
            prices.seconds(ev) / rl.eval_every, mean(lambda s: s.dropped),
            mean(lambda s: s.prefill_tokens(p)), tuple(ages / ages.sum()),
            float(ages @ np.arange(len(ages)) / ages.sum()), int(np.flatnonzero(ages).max()),
            mean(prices.alt_seconds), prices.alt_seconds(ev) / rl.eval_every))
    return rows


@dataclasses.dataclass(frozen=True)
class Split:
    sampler_chips: int
    sampler_s: float   # sample + amortized eval + weight push, on the sampler's chips
    trainer_s: float   # score passes + updates, on the trainer's chips

    @property
    def step_s(self) -> float:
        return max(self.sampler_s, self.trainer_s)


def placements(row: ScheduleRow, chips: int, slots: int, rows_fit: int,
               update_fixed_gib: float, update_temp_gib: float, hbm_gib: float,
               weight_bytes: float, chip: ChipSpec, step: int = 8) -> list[Split]:
    """A separate sampler mesh of s chips beside a trainer of t = chips − s, the sampler
    one step ahead (it samples batch k + 1 with θ_k while the trainer updates on batch k,
    so the batch is one version older than `row`'s; the version count stays), weights
    pushed after each update. The model: a decode step is bound by its rows' KV cache and
    its weights, both per chip ∝ 1/s, so the sampler's seconds scale by chips/s; score
    and updates are bound by FLOPs over t chips, chips/t. The push: weight_bytes over the
    min(s, t) chips' ICI links. Feasible splits only: slots/s ≤ rows_fit rows per chip,
    and the update's weights and optimizer state (update_fixed_gib per chip on all the
    chips, ∝ 1/t) plus its activations (update_temp_gib, one row per chip a micro-batch)
    within hbm_gib. Each split's step is max(sampler side, trainer side)."""
    out = []
    for s in range(step, chips, step):
        t = chips - s
        if slots / s > rows_fit or update_fixed_gib * chips / t + update_temp_gib > hbm_gib:
            continue
        push = weight_bytes / (min(s, t) * chip.ici_bw)
        out.append(Split(s, (row.sample_s + row.eval_s) * chips / s + push,
                         (row.score_passes * row.score_s + row.train_s) * chips / t))
    return out


class TrainShare(NamedTuple):
    """The share of the compiled (full-width, full-capacity) score / update program that
    a step at drawn lengths runs: padded rows cut to the step's longest row (rl.trim_bucket
    as 1), or packed rows (rl.pack_tokens) in the micro-batches the fullest shard uses."""

    padded_width: float   # mean slots of a trimmed padded row
    padded_share: float   # mean model FLOPs of the trimmed step / the full-width step
    packed_count: int     # an update's packed micro-batches (its program's capacity)
    update_used: float    # mean micro-batches an update runs (rows balanced over the
                          # shards: packing.balance_rows)
    update_share: float   # update_used / packed_count
    score_share: float    # the same share of the score step (rows as sampled)


def train_shares(cfg, completions_KxB: np.ndarray, prompt_tokens: int) -> TrainShare:
    """`TrainShare` of K steps of B responses with these completion lengths, each behind
    a prompt of `prompt_tokens`: the padded step's FLOPs at the trimmed width
    (model/flops.py), and the packed steps' micro-batches (each shard's sequences
    first-fit into rows of rl.pack_tokens, rl.pack_rows rows per micro-batch; the score
    packs the rows as sampled, each update the mini-batch's rows balanced over the
    shards as the loop orders them)."""
    import jax
    import jax.numpy as jnp

    rl, mc = cfg.rl, cfg.model
    full = cfg.task.max_prompt_len + cfg.sampling.max_new_tokens
    widths = prompt_tokens + completions_KxB.max(axis=1)
    b = completions_KxB.shape[1]
    share = np.mean([train_flops(mc, b, w - 1) / train_flops(mc, b, full - 1) for w in widths])
    if not rl.pack_tokens:
        return TrainShare(float(widths.mean()), float(share), 0, 0.0, 0.0, 0.0)
    shards = cfg.mesh[0] * cfg.mesh[1] * cfg.mesh[2]
    per_shard, count = packing.micro_batches(b // rl.num_minibatches, shards, rl.pack_rows)

    def used(seqs):  # micro-batches the fullest shard needs, by packing.py's own plan
        fill = jax.vmap(packing.first_fit_decreasing, (0, None))(
            jnp.asarray(seqs.reshape(shards, -1), jnp.int32), rl.pack_tokens)[3]
        rows = int(jnp.max(jnp.sum(fill > 0, axis=1)))
        return -(-rows // per_shard)

    score_count = packing.micro_batches(b, shards, rl.pack_rows)[1]
    score, update = [], []
    for step in completions_KxB + prompt_tokens:
        score.append(used(step) / score_count)
        for mini in step.reshape(rl.num_minibatches, -1):
            order = packing.balance_rows(np.arange(len(mini)), mini, shards)
            update.append(used(mini[order]))
    return TrainShare(float(widths.mean()), float(share), count, float(np.mean(update)),
                      float(np.mean(update)) / count, float(np.mean(score)))

"""The sampler's schedules priced (compiler / roofline estimates, not measurements):
length-aware estimates of a sample step, the evaluation and a global step, and a stated model of
a separate sampler mesh (`placements`, scaled from these colocated numbers).

Letters as in stablerl_jax/pod/sampler_schedules.py: P prompt slots, C = max_new_tokens, O
decode-slot offsets (a write slot is P + o), R responses of a stream.

The schedules (static passes, continuous refilling, partial rollouts) give each decode step's
largest write slot at given response lengths. A step costs the decode step at that slot
(roofline.py: the static step plus its extra key blocks; with a ragged decode attention, a
`ragged` row of DECODE_IMPLS as model.decode_attention_impl, each row's own blocks); a prefilled
row of P + t tokens its forward FLOPs at the chips' peak. A global step adds a score pass per
token version in the batch (behavior π_old), the updates and the amortized evaluation."""
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
    """Seconds on one chip: decode_O[o], a decode step with largest write slot P + o (o < C;
    first step + L·(extra blocks) blocks); once_s, a call's collectives outside the decode loop;
    `prefill_s`, rows of P + t tokens at the chips' peak; `ragged`: rows read own key blocks."""

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
        """One sampler run (a sampler_schedules.Sampling): `row_reads_seconds` for a ragged
        attention (DECODE_IMPLS' `ragged` rows) unless the rows share a slot (static passes:
        every row, finished or not, reads up to it), else `max_slot_seconds`."""
        ragged = self.ragged and not s.shared_slot
        return (self.row_reads_seconds if ragged else self.max_slot_seconds)(s)

    def alt_seconds(self, s) -> float:
        """`seconds` with the other decode attention: the what-if of the other kind."""
        return dataclasses.replace(self, ragged=not self.ragged).seconds(s)

    def max_slot_seconds(self, s) -> float:
        """Decode steps reading every row's key blocks up to the step's largest write slot (the
        reference "blocks"), prefills and reshard."""
        return s.runs.sum_of(self.decode_O) + self.prefill_s(s.prefills) + self.once_s

    def row_reads_seconds(self, s) -> float:
        """The same when each row reads its own key blocks (the ragged kernel, like paged
        attention): steps at the first-slot cost, plus, per token written at P + o, 1/slots of a
        step's extra cost there (decode_O[o] − decode_O[0]): a block costs per row what the
        reference's costs over its rows. A free slot (continuous tail) reads only its prompt."""
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
    """A schedule's global step, per-step means (partial rollouts: the later, steady-state
    half); eval_s amortized (÷ eval_every); score_passes: one per batch version (π_old)."""

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
    """Static, continuous and partial rollouts (each S of `staleness`) over stream lengths_R (≥
    steps·B + slots; static and continuous take step-sized slices), priced by `prices`;
    evaluation (eval_lengths: eval_problems × eval_k rows) static for static, else continuous."""
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
    """A sampler mesh of s chips beside a trainer of t = chips − s, a step ahead (sampling batch
    k + 1 with θ_k while the trainer updates on batch k: one version older than `row`'s, the
    version count unchanged), weights pushed after each update. Decode is bound by KV cache and
    weights (∝ 1/s per chip): sampler seconds × chips/s; score and updates are FLOP bound: ×
    chips/t; the push: weight_bytes over min(s, t) chips' ICI links. Feasible only if slots/s ≤
    rows_fit and update_fixed_gib × chips/t (weights, optimizer state) + update_temp_gib
    (activations, one row per chip a micro-batch) ≤ hbm_gib. Step: max of the two sides."""
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
    """Share of the compiled full-width, full-capacity score / update program that a step at
    drawn lengths runs: padded rows cut to the longest (rl.trim_bucket as 1), or packed rows
    (rl.pack_tokens) in the micro-batches the fullest shard uses."""

    padded_width: float   # mean slots of a trimmed padded row
    padded_share: float   # mean model FLOPs of the trimmed step / the full-width step
    packed_count: int     # an update's packed micro-batches (its program's capacity)
    update_used: float    # mean micro-batches an update runs (rows balanced over the
                          # shards: packing.balance_rows)
    update_share: float   # update_used / packed_count
    score_share: float    # the same share of the score step (rows as sampled)


def train_shares(cfg, completions_KxB: np.ndarray, prompt_tokens: int) -> TrainShare:
    """`TrainShare` of K steps of B responses with these completion lengths after
    `prompt_tokens`-token prompts: the padded step's FLOPs at the trimmed width
    (model/flops.py); the packed steps' micro-batches (each shard's sequences first-fit into
    rl.pack_tokens rows, rl.pack_rows per micro-batch; score packs rows as sampled, each update
    its mini-batch balanced over the shards as the loop orders it)."""
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

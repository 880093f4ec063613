"""The length-aware estimates of stablerl_jax/pod/schedule_prices.py fed synthetic per-step costs (no
compile): a decode step priced at its largest write slot, the static schedule of
all-truncated responses equal to the fixed-length sample estimate, hand-derived global
steps of each schedule, and the sampler / trainer split."""
import numpy as np
import pytest

from stablerl_jax import presets
from stablerl_jax.model.flops import forward_flops
from stablerl_jax.pod import roofline, sampler_schedules, schedule_prices

# Round constants so that seconds are the cost numbers themselves.
CHIP = roofline.ChipSpec(peak_flops=1.0, hbm_bw=1.0, ici_bw=1.0, source="test")
# tiny: B = 128 (16 prompts × G = 8), 128 slots, P = 16, C = 40, L = 2; blocks of 8 slots.
# The hand counts below read an evaluation every 20 steps of 128 problems × 4.
CFG = presets.preset("tiny", ["model.decode_block=8", "rl.eval_every=20", "rl.eval_problems=128"])
COSTS = roofline.SamplerCosts(first=roofline.Cost(0.0, 10.0, 1.0), layer=None,
                              block=roofline.Cost(0.0, 2.0, 0.0), head=None,
                              once_collective_bytes=5.0)


def _prices(chips=4):
    return schedule_prices.sampler_prices(CFG, COSTS, chips, CHIP)


def test_a_decode_step_costs_the_key_blocks_up_to_its_write_slot():
    # Slot 16 + o reads ⌊(16 + o) / 8⌋ − 2 blocks beyond the first step's, each L = 2
    # layers × 2 bytes: 11 s for o < 8, 15 s for 8 ≤ o < 16, …, 11 + 4·4 = 27 s at o = 39.
    d = _prices().decode_O
    assert d.shape == (40,)
    assert d[:8].tolist() == [11.0] * 8 and d[8:16].tolist() == [15.0] * 8 and d[39] == 27.0
    first, block = COSTS.first, COSTS.block
    for extra, n in roofline.extra_blocks(16, 40, 8).items():  # the fixed-length counts
        assert np.sum(d == (first + block.scale(2 * extra)).seconds(CHIP)) == n


def test_static_pricing_of_truncated_responses_is_the_fixed_length_estimate():
    # Every response C long: one pass of 40 steps (the sum of decode_O), the 128 rows'
    # prefill at peak over the chips, and the reshard: as roofline.sample_estimate.
    p = _prices(chips=4)
    s = sampler_schedules.static(np.full(128, 40), 128)
    expect = p.decode_O.sum() + forward_flops(CFG.model, 128, 16) / 4 + 5.0
    assert p.seconds(s) == pytest.approx(expect, rel=1e-12)
    # a re-prefilled row of t tokens costs a forward over P + t
    assert p.prefill_s([0, 24]) == pytest.approx(
        (forward_flops(CFG.model, 1, 16) + forward_flops(CFG.model, 1, 40)) / 4)


def test_row_reads_charge_each_row_its_own_key_blocks():
    # Rows of 1 and 12 tokens in 2 slots: 12 steps. Reading up to the largest slot, steps
    # 8..11 read 4 extra seconds' blocks for both rows (8 × 11 + 4 × 15 = 148); reading
    # each row's own, the 12-token row alone needs them, half of it: 12 × 11 + 4 × 2 = 140.
    p = _prices(chips=4)
    s = sampler_schedules.static(np.array([1, 12]), 2)
    fixed = p.prefill_s([0, 0]) + 5.0
    assert p.seconds(s) == pytest.approx(148 + fixed)
    assert p.row_reads_seconds(s) == pytest.approx(140 + fixed)
    equal = sampler_schedules.static(np.array([12, 12]), 2)  # equal rows: the same either way
    assert p.row_reads_seconds(equal) == pytest.approx(p.seconds(equal))


def test_a_ragged_decode_attention_prices_rows_at_their_own_slots_only():
    # With the ragged kernel (the paper preset's model.decode_attention_impl), the
    # continuous sampler's rows sit at their own slots: row reads. Static passes share
    # one write slot, so the finished row still reads up to it: the largest slot's price.
    ragged = schedule_prices.sampler_prices(
        CFG.replace(model=CFG.model.replace(kv_cache_layout="bksd",
                                            decode_attention_impl="pallas_tpu")),
        COSTS, 4, CHIP)
    blocks = _prices(chips=4)
    assert ragged.ragged and not blocks.ragged
    static = sampler_schedules.static(np.array([1, 12]), 2)
    cont = sampler_schedules.continuous(np.array([1, 12]), 2)
    assert ragged.seconds(static) == blocks.seconds(static) == ragged.max_slot_seconds(static)
    assert ragged.seconds(cont) == ragged.row_reads_seconds(cont) < blocks.seconds(cont)
    assert ragged.alt_seconds(cont) == blocks.seconds(cont)
    assert blocks.alt_seconds(cont) == ragged.seconds(cont)


def test_schedule_rows_of_fixed_lengths_by_hand():
    # All 128 responses 12 long, B = slots: every schedule decodes 12 steps per global
    # step at offsets 0..11 (8 × 11 + 4 × 15 = 148 s). Partial rollouts queue B + slots:
    # the slots freed at the last step take the next 128 responses (1-row prefills), and
    # the next step prefills them again with the new parameters: 256 prefilled rows.
    p = _prices()
    lengths = np.full(20 * 128 + 128, 12)
    evals = np.full(512, 12)  # 4 static passes of 12 steps, or 48 continuous steps
    rows = schedule_prices.schedule_rows(CFG, p, score_s=3.0, update_s=7.0, lengths_R=lengths,
                                  eval_lengths=evals, steps=20)
    assert [r.name for r in rows] == ["static", "continuous", "partial S = 1",
                                      "partial S = 2"]
    row_prefill = forward_flops(CFG.model, 1, 16) / 4
    decode = 8 * 11 + 4 * 15
    for r in rows:
        assert (r.steps, r.occupancy, r.score_passes, r.dropped) == (12, 1.0, 1, 0)
        rows_prefilled = 256 if r.name.startswith("partial") else 128
        assert r.sample_s == pytest.approx(decode + rows_prefilled * row_prefill + 5.0)
        assert r.eval_steps == 48
        assert r.eval_s == pytest.approx((4 * decode + 512 * row_prefill + 5.0) / 20)
        assert r.global_s == pytest.approx(r.sample_s + 3.0 + 7.0 + r.eval_s)
        assert r.global_alt_s == pytest.approx(r.global_s)  # equal rows
        assert r.age_share[0] == 1.0 and r.age_max == 0


def test_partial_rows_count_a_score_pass_per_version():
    # Lengths 1..40 in a cycle (groups of 8 mixed): S = 2 consumes tokens of up to 3
    # versions, so behavior π_old scores up to 3 times; proximal once.
    p = _prices()
    lengths = np.arange(20 * 128 + 128) % 40 + 1
    rows = schedule_prices.schedule_rows(CFG, p, 3.0, 7.0, lengths, np.full(512, 12), steps=20)
    part = rows[3]
    assert 1 < part.score_passes <= 3 and part.age_max <= 2
    assert part.global_s - part.global_proximal_s == pytest.approx(
        (part.score_passes - 1) * 3.0)
    assert sum(part.age_share) == pytest.approx(1.0)


def test_placements_scale_each_side_by_its_chips_and_keep_feasible_splits():
    row = schedule_prices.ScheduleRow("x", 1, 1, sample_s=100.0, score_passes=2, score_s=5.0,
                               train_s=30.0, eval_steps=1, eval_occupancy=1, eval_s=20.0)
    # 16 chips, splits of 8: s = 8 (t = 8). Sampler side (100 + 20)·16/8 + push 64 B over
    # 8 links = 248; trainer (2·5 + 30)·16/8 = 80.
    (sp,) = schedule_prices.placements(row, 16, slots=8, rows_fit=1, update_fixed_gib=1.0,
                                update_temp_gib=1.0, hbm_gib=3.0, weight_bytes=64.0,
                                chip=CHIP)
    assert (sp.sampler_chips, sp.sampler_s, sp.trainer_s, sp.step_s) == (8, 248.0, 80.0, 248.0)
    # 16 slots need 2 rows per chip on 8 chips; a trainer whose weights do not fit on 8
    assert schedule_prices.placements(row, 16, 16, 1, 1.0, 1.0, 3.0, 64.0, CHIP) == []
    assert schedule_prices.placements(row, 16, 8, 1, 1.0, 1.5, 3.0, 64.0, CHIP) == []

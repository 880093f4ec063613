"""The sampler schedules (stablerl_jax/pod/sampler_schedules.py): hand-derived small cases
of each, the event simulator against a step-by-step reference, the invariants of partial
rollouts (S = 0 is continuous, every consumed token's age ≤ S, the queue ≤ B + slots), and the
length specs."""
import math

import numpy as np
import pytest

from stablerl_jax.pod import sampler_schedules


def _continuous_reference(lengths, slots):
    """One decode step at a time, as the schedule is stated: (largest write offset per
    step, prefilled rows)."""
    pending, slot, gen = list(range(len(lengths))), [-1] * slots, {}
    for s in range(slots):
        if pending:
            slot[s] = pending.pop(0)
            gen[slot[s]] = 0
    offsets, prefills = [], sum(r >= 0 for r in slot)
    while any(r >= 0 for r in slot):
        offsets.append(max(gen[r] for r in slot if r >= 0))
        for s, r in enumerate(slot):
            if r >= 0:
                gen[r] += 1
                if gen[r] == lengths[r]:
                    slot[s] = -1
        for s in range(slots):
            if slot[s] < 0 and pending:
                slot[s] = pending.pop(0)
                gen[slot[s]], prefills = 0, prefills + 1
    return offsets, prefills


def test_static_runs_each_strided_pass_to_its_longest_row():
    # Passes [0, 2] and [1, 3]: max(1, 2) + max(4, 3) = 6 steps, each from slot P.
    s = sampler_schedules.static(np.array([1, 4, 2, 3]), 2)
    assert s.runs.steps == 6
    assert s.runs.offsets().tolist() == [0, 1, 0, 1, 2, 3]
    assert (len(s.prefills), s.tokens, s.occupancy) == (4, 10, 10 / 12)
    assert s.written_O.tolist() == [4, 3, 2, 1]  # rows longer than o
    static = sampler_schedules.static(np.array([1, 4, 2, 3]), 0)
    assert static.runs.offsets().tolist() == [0, 1, 2, 3]


def test_continuous_refills_freed_slots_by_hand():
    # [1, 4, 2, 3], 2 slots: r0 ends at step 1 (r2 takes slot 0), r2 at step 3 (r3 takes
    # slot 0), r1 at step 4, r3 at step 6. Largest write offset: 0, then r1's 1, 2, 3,
    # then r3's 1, 2.
    s = sampler_schedules.continuous(np.array([1, 4, 2, 3]), 2)
    assert s.runs.offsets().tolist() == [0, 1, 2, 3, 1, 2]
    assert (len(s.prefills), s.tokens) == (4, 10)
    assert s.written_O.tolist() == [4, 3, 2, 1]  # each response writes 0..ℓ−1, as static
    # [4, 1, 1, 4]: static needs max(4, 1) + max(1, 4) = 8 steps; continuous 6 (r1 and r2
    # pass through slot 1 while r0 runs, r3 ends two steps after r0).
    assert sampler_schedules.static(np.array([4, 1, 1, 4]), 2).runs.steps == 8
    s = sampler_schedules.continuous(np.array([4, 1, 1, 4]), 2)
    assert s.runs.offsets().tolist() == [0, 1, 2, 3, 2, 3]
    assert s.occupancy == 10 / 12


@pytest.mark.parametrize("seed", range(4))
def test_continuous_events_equal_the_step_by_step_reference(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, size=24)
    for slots in (1, 3, 8, 24, 32):
        s = sampler_schedules.continuous(lengths, slots)
        offsets, prefills = _continuous_reference(lengths.tolist(), slots)
        assert s.runs.offsets().tolist() == offsets
        assert len(s.prefills) == prefills == len(lengths)
        assert s.tokens == lengths.sum() == s.written_O.sum()
        assert s.written_O.tolist() == sampler_schedules.static(lengths, 0).written_O.tolist()


def test_runs_sum_a_value_per_decode_step():
    runs = sampler_schedules.Runs(np.array([3, 0, 5]), np.array([2, 1, 3]))
    values = np.arange(10.0) ** 2
    assert runs.offsets().tolist() == [3, 4, 0, 5, 6, 7]
    assert runs.sum_of(values) == sum(values[o] for o in runs.offsets())
    assert runs.sum_of(values) == 9 + 16 + 0 + 25 + 36 + 49


def _ages(steps):
    return [s.consumed_by_age.tolist() for s in steps]


def test_partial_rollouts_by_hand():
    # B = 2, G = 2 (Q = 1), 2 slots, S = 1; groups g0 [1, 1], g1 [4, 1], g2..g4 [1, 1].
    # k0: g0 ends at step 1 and is the batch; r2, r3 take the slots. k1: r3 ends (step
    # 1), r4 and r5 pass through slot 1, g2 is the batch; r2 carries 3 tokens of version
    # 1, r3 its one. k2: r2 is re-prefilled (3 tokens) and ends at its 4th token with r6,
    # so g1 (v1: 3 + 1 tokens, v2: 1) is the batch; r7 takes slot 0. k3: r6 (v2) is
    # carried, r7 and r8 end at step 1: g3 (ages 0 and 1).
    lengths = np.array([1, 1, 4, 1, 1, 1, 1, 1, 1, 1])
    steps = sampler_schedules.partial(lengths, 2, 2, 2, 1, 4)
    assert [s.runs.offsets().tolist() for s in steps] == [[0], [0, 1, 2], [3], [0]]
    assert [s.prefills.tolist() for s in steps] == [[0, 0, 0, 0], [0, 0, 0, 0], [3, 0, 0],
                                                    [0, 0, 0]]
    assert _ages(steps) == [[2], [2], [1, 4], [1, 1]]  # tokens by age 0, 1, …
    assert steps[2].written_O.tolist() == [1, 0, 0, 1]  # r6 at offset 0, r2 at 3
    assert [s.dropped for s in steps] == [0, 0, 0, 0]
    assert [s.queue for s in steps] == [4, 4, 4, 4]


def test_partial_rollouts_drop_responses_older_than_s():
    # As above with r2 of length 6: at k2 it is still running (5 tokens, version 1); at
    # k3 its oldest token and its finished sibling r3's are older than k − S = 2, so both
    # restart (tokens discarded), and g4 is the batch. With S = 2 nothing is dropped.
    lengths = np.array([1, 1, 6, 1, 1, 1, 1, 1, 1, 1])
    steps = sampler_schedules.partial(lengths, 2, 2, 2, 1, 4)
    assert [s.dropped for s in steps] == [0, 0, 0, 2]
    assert [s.runs.offsets().tolist() for s in steps] == [[0], [0, 1, 2], [3, 4], [0, 1, 2]]
    assert _ages(steps)[3] == [2]
    assert [s.dropped for s in sampler_schedules.partial(lengths, 2, 2, 2, 2, 4)] == [0, 0, 0, 0]


@pytest.mark.parametrize("seed", range(3))
def test_partial_with_s_0_is_continuous_step_by_step(seed):
    rng = np.random.default_rng(seed)
    b, k = 16, 3
    lengths = rng.integers(1, 40, size=k * b + 8)
    for slots in (4, 8, 16):
        for i, s in enumerate(sampler_schedules.partial(lengths, b, 4, slots, 0, k)):
            c = sampler_schedules.continuous(lengths[i * b:(i + 1) * b], slots)
            assert s.runs.offsets().tolist() == c.runs.offsets().tolist()
            assert s.prefills.tolist() == c.prefills.tolist()
            assert (s.dropped, s.consumed_by_age.sum()) == (0, lengths[i * b:(i + 1) * b].sum())


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_partial_consumes_tokens_at_most_s_steps_old_from_a_bounded_queue(staleness):
    rng = np.random.default_rng(staleness)
    b, g, slots, k = 32, 4, 16, 12
    lengths = np.minimum(np.ceil(rng.lognormal(3.0, 1.0, k * b + slots)), 200).astype(int)
    steps = sampler_schedules.partial(lengths, b, g, slots, staleness, k)
    for s in steps:
        ages = s.consumed_by_age
        assert ages[staleness + 1:].sum() == 0
        assert s.queue <= b + slots
        # whole groups, each response's tokens all consumed (the attempt that finished)
        assert sorted(set(s.batch // g)) == sorted((s.batch // g)[::g].tolist())
        assert len(s.batch) == b and ages.sum() == lengths[s.batch].sum()
    consumed = np.concatenate([s.batch for s in steps])
    assert len(set(consumed.tolist())) == len(consumed)
    assert sum(s.dropped for s in steps) > 0 or staleness > 1


def test_lognormal_lengths_have_the_stated_mean_and_truncated_share():
    rng = np.random.default_rng(0)
    x = sampler_schedules.lengths_from_spec("lognormal:mean=100", 10**9, 200_000, rng)
    assert abs(x.mean() - 100.5) < 1  # ceil adds ≈ 0.5; sd 86 / √200k ≈ 0.2
    # Share above the cap: 1 − Φ((ln C − μ) / σ) with μ = ln m − σ²/2; at m = C/4 and
    # σ = 0.75: 1 − Φ((ln 4 + 0.28125) / 0.75) ≈ 0.0131.
    x = sampler_schedules.lengths_from_spec("lognormal:mean=8192", 32_768, 100_000, rng)
    sigma = sampler_schedules.DEFAULT_SIGMA
    z = (math.log(4) + sigma**2 / 2) / sigma
    assert abs((x == 32_768).mean() - 0.5 * math.erfc(z / math.sqrt(2))) < 0.002
    assert x.min() >= 1 and x.max() == 32_768
    y = sampler_schedules.lengths_from_spec("lognormal:mean=8192,sigma=0.1", 32_768, 1000, rng)
    assert y.max() < 32_768


def test_fixed_and_file_lengths(tmp_path):
    rng = np.random.default_rng(0)
    assert sampler_schedules.lengths_from_spec("fixed:7", 10, 3, rng).tolist() == [7, 7, 7]
    (tmp_path / "a.txt").write_text("3\n5\n40\n")
    (tmp_path / "b.json").write_text("[3, 5, 40]")
    for name in ("a.txt", "b.json"):
        x = sampler_schedules.lengths_from_spec(f"file:{tmp_path / name}", 10, 500, rng)
        assert set(x.tolist()) == {3, 5, 10}  # 40 > cap is truncated at 10


@pytest.mark.parametrize("spec,field", [
    ("lognormal:mean=-3", "mean"), ("lognormal:mean=x", "mean"), ("lognormal:sigma=1", "mean="),
    ("lognormal:mean=8,sigma=0", "sigma"), ("lognormal:mean=8,mu=2", "'mu=2'"),
    ("fixed:0", "N"), ("fixed:2.5", "N"), ("fixed:11", "N"), ("gamma:mean=3", "unknown form"),
    ("8192", "unknown form")])
def test_bad_length_specs_name_the_field(spec, field):
    with pytest.raises(ValueError, match=field) as e:
        sampler_schedules.lengths_from_spec(spec, 10, 4, np.random.default_rng(0))
    assert "lognormal:mean=8192" in str(e.value)  # the forms, i.e. the fix


def test_bad_length_files_are_refused(tmp_path):
    (tmp_path / "bad.txt").write_text("3\nabc\n")
    (tmp_path / "zero.txt").write_text("0\n")
    for name in ("bad.txt", "zero.txt"):
        with pytest.raises(ValueError, match="file"):
            sampler_schedules.lengths_from_spec(f"file:{tmp_path / name}", 10, 4,
                                       np.random.default_rng(0))


def test_train_shares_of_padded_and_packed_steps_by_hand():
    """Two steps of 8 responses on 2 batch shards: padded, each step's FLOP share at its
    longest row; packed into rows of 40 slots (prompts of 16), one row per shard per
    micro-batch, the micro-batches the fullest shard needs."""
    from rl_helpers import tiny_cfg

    from stablerl_jax.model.flops import train_flops
    from stablerl_jax.pod import schedule_prices
    comp = np.array([[16, 16, 16, 16, 4, 4, 4, 4],     # shard 0: 32-token rows alone; shard 1: 20+20
                     [4, 4, 4, 4, 4, 4, 4, 4]])       # every shard: 20+20, 20+20
    cfg = tiny_cfg(mesh=(2, 1, 1), num_minibatches=1, pack_tokens=40, pack_rows=2)
    sh = schedule_prices.train_shares(cfg, comp, 16)
    full = train_flops(cfg.model, 8, 31)
    assert sh.padded_width == (32 + 20) / 2
    assert math.isclose(sh.padded_share, (train_flops(cfg.model, 8, 31) / full
                                          + train_flops(cfg.model, 8, 19) / full) / 2)
    # The score packs the rows as sampled. Step 1: shard 0 needs 4 rows (four 32s), shard
    # 1 two (pairs of 20): 4 micro-batches of one row per shard; step 2: two rows in each
    # shard: 2. The update's rows are balanced first (two 32s and two 20s per shard:
    # three rows each), so step 1 needs 3.
    assert sh.packed_count == 4 and sh.score_share == (4 + 2) / 2 / 4
    assert (sh.update_used, sh.update_share) == (2.5, 2.5 / 4)
    padded = schedule_prices.train_shares(tiny_cfg(mesh=(2, 1, 1)), comp, 16)
    assert padded.packed_count == 0 and padded.padded_share == sh.padded_share


def test_balanced_rows_give_each_shard_about_the_same_tokens():
    from stablerl_jax import packing
    rows = np.array([7, 3, 5, 1, 0, 2, 6, 4])
    tokens = np.array([32, 32, 32, 32, 20, 20, 20, 20])
    out = packing.balance_rows(rows, tokens, 2)
    assert sorted(out) == sorted(rows)
    by_row = dict(zip(rows, tokens))
    assert [sum(by_row[r] for r in half) for half in (out[:4], out[4:])] == [104, 104]
    np.testing.assert_array_equal(out, packing.balance_rows(rows, tokens, 2))
    with pytest.raises(ValueError, match="shards"):
        packing.balance_rows(rows[:7], tokens[:7], 2)

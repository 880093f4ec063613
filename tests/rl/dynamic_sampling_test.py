"""Dynamic sampling (rl.dynamic_sampling, rl/dynamic.py): no group of equal rewards reaches
an update; the batch fills with Q groups in rounds, or trains short with padding that
carries no loss and says so; rounds are seeded by (seed, step, round), so runs repeat and
resume exactly; the settings it cannot run with are refused."""
import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg
from tolerance import assert_close, backward_chain

from stablerl_jax.config import ConfigError, RLConfig
from stablerl_jax.data.task import TaskData
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import dynamic, loop
from stablerl_jax.rl.engine import Engine
from stablerl_jax.runs.metrics_io import outcome, read_metrics

ROUNDS, STEPS = 2, 3


def _cfg(**rl):
    return tiny_cfg(**{"steps": STEPS, "dynamic_sampling": True,
                       "max_sampling_rounds": ROUNDS, **rl})


@dataclasses.dataclass
class ChosenRewards(TaskData):
    """The task with rewards chosen by the test: every train prompt's answer is "#i" (its
    index), a prompt in `flat` gets 0 for each response (a group of equal rewards), any
    other 1 for the first response of its group and 0 for the rest (a spread). Eval sets
    keep the task's reward."""

    flat: frozenset = frozenset()

    def reward_with_source(self, rollout, answers):
        if not str(answers[0]).startswith("#"):
            return super().reward_with_source(rollout, answers)
        g = tiny_cfg().rl.group_size  # rows are whole groups, from a group's first row
        first = np.arange(len(answers)) % g == 0
        flat = np.array([int(a[1:]) in self.flat for a in answers])
        return np.where(first & ~flat, 1.0, 0.0).astype(np.float32), ["test"] * len(answers)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    cfg = tiny_cfg()
    data = TaskData.create(cfg.task, cfg.model.vocab_size,
                           str(tmp_path_factory.mktemp("data")))
    train = [{**r, "answer": f"#{i}"} for i, r in enumerate(data.train)]
    return dataclasses.replace(data, train=train)


def _index_stream(step, r):
    """(batch, stream): the extra rounds read batch step·(R − 1) + r − 1 of stream 2."""
    return (step, 0) if r == 0 else (step * (ROUNDS - 1) + r - 1, 2)


def _train_indices(data, step, r, q, seed):
    index, stream = _index_stream(step, r)
    return data.train_indices(index, q, seed, stream)


def _expected(rounds_by_step, flat, q):
    """(rounds, kept, batch prompts) of each step, the groups taken in drawn order."""
    out = []
    for rounds in rounds_by_step:
        kept, batch, used = 0, [], 0
        for prompts in rounds:
            used += 1
            spread = [int(i) for i in prompts if int(i) not in flat]
            kept += len(spread)
            batch += spread[:q - len(batch)]
            if len(batch) == q:
                break
        out.append((used, kept, batch))
    return out


@pytest.fixture(scope="module")
def scenario(task):
    """A flat set under which step 0 fills in two rounds, step 1 stays short after both
    and step 2 fills in its first; with the prompts each round draws."""
    cfg = _cfg()
    q = cfg.rl.prompts_per_step
    draws = [[_train_indices(task, k, r, q, cfg.rl.seed) for r in range(ROUNDS)]
             for k in range(STEPS)]
    flat = set(draws[0][0][:2].tolist()) | set(draws[1][0].tolist()) | set(
        draws[1][1][1:].tolist())
    flat -= set(draws[0][0][2:].tolist()) | set(draws[0][1].tolist()) | {
        int(draws[1][1][0])} | set(draws[2][0].tolist())
    return ChosenRewards(**vars(task), flat=frozenset(flat)), draws


@pytest.fixture(scope="module")
def full_run(scenario, tmp_path_factory):
    """A 3-step run with what every score and update step received recorded."""
    data, _ = scenario
    seen = {"score": [], "update": []}
    score, update = Engine.score, Engine.update

    def recording_score(self, params, rollout, rewards_B, age_BxS=None):
        batch, metrics = score(self, params, rollout, rewards_B, age_BxS)
        seen["score"].append((np.asarray(rewards_B), np.asarray(rollout.completion_mask_BxS),
                              np.asarray(batch.mask_BxT), np.asarray(batch.advantages_B)))
        return batch, metrics

    def recording_update(self, state, batch):
        seen["update"].append((np.asarray(batch.mask_BxT), np.asarray(batch.advantages_B)))
        return update(self, state, batch)

    workdir = str(tmp_path_factory.mktemp("full"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "score", recording_score)
        mp.setattr(Engine, "update", recording_update)
        loop.run(_cfg(), workdir, data=data, progress=False)
    return workdir, seen


def test_fill_takes_spread_groups_in_order_and_pads_the_rest():
    fill = dynamic.Fill(q=3, g=2)
    # Round 1: groups 0 and 2 spread, group 1 flat.
    src = fill.add(np.array([10, 11, 12]), np.array([1, 0, 1, 1, 0, 1], np.float32))
    np.testing.assert_array_equal(src, [0, 1, 4, 5, -1, -1])
    assert fill.prompts == [10, 12] and not fill.full
    np.testing.assert_array_equal(fill.real_B(), [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(fill.rewards_B(), [1, 0, 0, 1, 0, 0])
    # Round 2: groups 1 and 2 spread; only group 1 fits, into slot 2.
    src = fill.add(np.array([20, 21, 22]), np.array([0, 0, 0, 1, 1, 0], np.float32))
    np.testing.assert_array_equal(src, [-1, -1, -1, -1, 2, 3])
    assert fill.prompts == [10, 12, 21] and fill.full
    np.testing.assert_array_equal(fill.rewards_B(), [1, 0, 0, 1, 0, 1])
    assert fill.metrics() == {"dynamic/kept_frac": 4 / 6, "dynamic/rounds": 2.0,
                              "dynamic/filled_frac": 1.0}
    empty = dynamic.Fill(q=2, g=2)
    empty.add(np.array([1, 2]), np.zeros(4))
    assert empty.metrics()["dynamic/filled_frac"] == 0.0 and not empty.rewards_B().any()


def _rollout64(cfg):
    """A rollout of 8 rows from the tiny model, in float64 with its float64 model."""
    params = tf.init_params(jax.random.key(0), cfg.model)
    prompts = jax.random.randint(jax.random.key(1), (8, 8), 4, 60)
    ro = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID).sample(
        params, prompts, jnp.ones((8, 8), bool), jax.random.key(2))
    f64 = lambda t: jax.tree.map(
        lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, t)
    return f64(params), f64(ro), cfg.model.replace(param_dtype="float64",
                                                   compute_dtype="float64")


def test_padded_groups_are_empty_responses_that_carry_no_loss(x64):
    """Two real groups and two padded ones: the update equals the update on the two real
    groups alone (float64: only summation order differs), the padding rows hold their
    prompt and nothing else."""
    cfg = tiny_cfg(num_minibatches=1)
    params, ro, model = _rollout64(cfg)
    eng = Engine.create(cfg.replace(model=model), eos_id=EOS_ID, pad_id=PAD_ID)
    # Batch rows 0-3 take the sampled rows 4-7 (its groups 2 and 3); rows 4-7 keep what
    # they hold (the same sampled rows) as padding.
    src_B = np.array([4, 5, 6, 7, -1, -1, -1, -1], np.int32)
    real_B = np.arange(8) < 4
    merged = jax.tree.map(np.asarray, eng.merge_rows(ro, ro, src_B, real_B))
    ro = jax.tree.map(np.asarray, ro)
    for name, x in merged._asdict().items():
        if x is not None:
            np.testing.assert_array_equal(x[:4], getattr(ro, name)[4:], err_msg=name)
    p = 8  # prompt slots: completions start here
    np.testing.assert_array_equal(merged.prompt_mask_BxS[4:], ro.prompt_mask_BxS[4:])
    np.testing.assert_array_equal(merged.tokens_BxS[4:, :p], ro.tokens_BxS[4:, :p])
    np.testing.assert_array_equal(merged.routes_mu_BxSxLxK[4:, :p], ro.routes_mu_BxSxLxK[4:, :p])
    assert not merged.completion_mask_BxS[4:].any() and not merged.lengths_B[4:].any()
    assert (merged.tokens_BxS[4:, p:] == PAD_ID).all() and not merged.logp_mu_BxS[4:].any()
    assert (merged.routes_mu_BxSxLxK[4:, p:] == -1).all() and not merged.truncated_B[4:].any()

    rewards = np.array([1, 0, 0, 1], np.float32)
    padded, _ = eng.score(params, merged, np.concatenate([rewards, np.zeros(4, np.float32)]))
    np.testing.assert_array_equal(padded.mask_BxT[4:], 0)
    np.testing.assert_array_equal(padded.advantages_B[4:], 0)
    alone_cfg = tiny_cfg(num_minibatches=1, prompts_per_step=2).replace(model=model)
    alone = Engine.create(alone_cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    real, _ = alone.score(params, jax.tree.map(lambda x: x[4:], ro), rewards)
    results = []
    for engine, batch in ((eng, padded), (alone, real)):
        state, metrics = engine.update(engine.init_state(params), batch)
        results.append((jax.tree.map(np.asarray, state.params), float(metrics["loss"][0])
                        / float(metrics["loss"][1]), float(metrics["grad_norm"][0])))
    assert results[1][2] > 0  # the real groups do train
    tokens = int((ro.prompt_mask_BxS | ro.completion_mask_BxS).sum())
    n = backward_chain(model, ro.tokens_BxS.shape[1], tokens) + 16  # + AdamW
    for a, b in zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(results[1][0])):
        assert_close(a, b, n=n, dtype="float64", cond=tokens, scale="max")
    for i in (1, 2):
        assert_close(results[0][i], results[1][i], n=n, dtype="float64", cond=tokens)


@pytest.mark.integration
def test_no_group_of_equal_rewards_reaches_an_update(full_run):
    _, seen = full_run
    g = tiny_cfg().rl.group_size
    assert len(seen["score"]) == STEPS
    for rewards_B, completion_BxS, mask_BxT, adv_B in seen["score"]:
        r_QxG = rewards_B.reshape(-1, g)
        flat_Q = r_QxG.max(1) == r_QxG.min(1)
        scored_Q = mask_BxT.reshape(len(flat_Q), -1).any(1)
        # A group is scored iff its rewards differ; a flat one is padding: no completion.
        np.testing.assert_array_equal(scored_Q, ~flat_Q)
        assert not completion_BxS.reshape(len(flat_Q), -1)[flat_Q].any()
        assert not adv_B.reshape(-1, g)[flat_Q].any()
    # What the updates saw: every response with a scored token has Â != 0.
    assert len(seen["update"]) == STEPS * tiny_cfg().rl.num_minibatches
    for mask_MxT, adv_M in seen["update"]:
        assert (adv_M[mask_MxT.any(1)] != 0).all()


@pytest.mark.integration
def test_the_batch_fills_in_rounds_or_says_it_is_short(full_run, scenario):
    workdir, seen = full_run
    data, draws = scenario
    cfg = _cfg()
    q, g = cfg.rl.prompts_per_step, cfg.rl.group_size
    rows = read_metrics(workdir)[1:]
    comp = read_metrics(f"{workdir}/minibatches.jsonl")
    expected = _expected(draws, data.flat, q)
    # The scenario covers the three cases: filled in two rounds, short, filled at once.
    assert [(u, len(b)) for u, _, b in expected] == [(2, q), (2, 1), (1, q)]
    for row, c, (used, kept, batch), (rewards_B, *_), step_draws in zip(
            rows, comp, expected, seen["score"], draws):
        assert row["dynamic/rounds"] == used
        assert row["dynamic/kept_frac"] == kept / (used * q)
        assert row["dynamic/filled_frac"] == len(batch) / q
        assert c["prompts"] == batch
        assert c["sampled"] == [d.tolist() for d in step_draws[:used]]
        # The scored rewards: each real group's (1, 0), then zeros for the padding.
        np.testing.assert_array_equal(
            rewards_B, np.repeat(np.arange(q) < len(batch), g) * (np.arange(q * g) % g == 0))
        # `reward` is over every response sampled: one 1 per spread group.
        assert row["reward"] == kept / (used * q * g)
    short = rows[1]
    assert short["dynamic/filled_frac"] == 0.25 and short["skipped_updates"] == 0
    # The summary counts the short step; none was empty.
    summary = json.loads(open(f"{workdir}/summary.json").read())
    assert (summary["short_batches"], summary["empty_batches"]) == (1, 0)


@pytest.mark.integration
def test_same_seed_same_run_and_exact_resume(full_run, scenario, tmp_path):
    """A second run of the same seed stopped after step 2 equals the first, and resumed
    to step 3 from its checkpoint it still does: metrics and compositions."""
    full, _ = full_run
    data, _ = scenario
    rows, comp = read_metrics(full), read_metrics(f"{full}/minibatches.jsonl")
    part = str(tmp_path / "part")
    loop.run(_cfg(steps=2), part, data=data, progress=False)
    assert outcome(read_metrics(part))[:2] == outcome(rows)[:2]
    assert read_metrics(f"{part}/minibatches.jsonl") == comp[:2]
    loop.run(_cfg(), part, data=data, progress=False)
    assert outcome(read_metrics(part)) == outcome(rows)
    assert read_metrics(f"{part}/minibatches.jsonl") == comp


@pytest.mark.integration
def test_with_every_group_kept_it_is_the_run_without_it(task, tmp_path):
    """Round 0 is the step's own prompts and sampler key: when it keeps every group the
    run is the run without dynamic sampling, bit for bit, plus the `dynamic/…` metrics."""
    data = ChosenRewards(**vars(task))  # no flat prompt
    runs = {}
    for on in (False, True):
        loop.run(_cfg(steps=2, dynamic_sampling=on), str(tmp_path / str(on)), data=data,
                 progress=False)
        runs[on] = (outcome(read_metrics(str(tmp_path / str(on)))),
                    read_metrics(str(tmp_path / str(on) / "minibatches.jsonl")))
    (rows_on, comp_on), (rows_off, comp_off) = runs[True], runs[False]
    for row in rows_on[1:]:
        assert {k: row.pop(k) for k in [k for k in row if k.startswith("dynamic/")]} == {
            "dynamic/kept_frac": 1.0, "dynamic/rounds": 1.0, "dynamic/filled_frac": 1.0}
    assert rows_on == rows_off
    for c_on, c_off in zip(comp_on, comp_off):
        assert c_on.pop("sampled") == [c_off["prompts"]]
    assert comp_on == comp_off


def test_a_short_batch_warns_once_and_empty_ones_in_a_row_stop_the_run(caplog):
    watch = dynamic.ShortBatches(limit=3)
    row = lambda filled: {"dynamic/filled_frac": filled, "dynamic/rounds": 4.0}
    with caplog.at_level(logging.WARNING):
        for step, filled in enumerate([1.0, 0.5, 0.0, 0.25, 0.0, 0.0], start=1):
            watch.check(step, row(filled))  # two empty in a row, then full: no stop
        assert len(caplog.records) == 1 and "step 2 trained on 50% of a batch" in caplog.text
        with pytest.raises(ValueError) as e:
            watch.check(7, row(0.0))
    msg = str(e.value)
    assert msg.startswith("rl.dynamic_sampling: 3 steps in a row (up to step 7)") and (
        "\n" not in msg and "rl.max_sampling_rounds" in msg)
    watch.check(8, {})  # no dynamic sampling: nothing watched


def test_more_rounds_than_the_train_split_holds_are_refused(task):
    from types import SimpleNamespace

    from stablerl_jax.rl import preflight
    q = _cfg().rl.prompts_per_step
    # Synthetic data: refused with the config (task.num_train is the split's size).
    with pytest.raises(ConfigError) as e:
        _cfg(max_sampling_rounds=1_000_000)
    assert str(e.value) == (
        f"rl.max_sampling_rounds: 1000000 rounds of rl.prompts_per_step={q} prompts is more "
        f"than the train split's task.num_train=64 problems (a step would draw prompts "
        f"again); set rl.max_sampling_rounds=16 or fewer")
    # A file's split: refused once it is read (a config that passed the first check).
    most = len(task.train) // q
    preflight.check_sampling_rounds(_cfg(max_sampling_rounds=most), task)
    read_later = SimpleNamespace(rl=SimpleNamespace(
        dynamic_sampling=True, offline_rollouts="", prompts_per_step=q,
        max_sampling_rounds=1_000_000))
    with pytest.raises(ConfigError) as e:
        preflight.check_sampling_rounds(read_later, task)
    assert str(e.value) == (
        f"rl.max_sampling_rounds=1000000: 1000000 rounds of rl.prompts_per_step={q} prompts "
        f"is more than the train split's {len(task.train)} problems (a step would draw "
        f"prompts again); set rl.max_sampling_rounds={most} or fewer")


@pytest.mark.integration
def test_a_run_whose_groups_never_differ_stops_in_one_line(task, tmp_path):
    """Every reward equal: each step's batch is empty; the run stops after
    rl.max_consecutive_skips of them, its checkpoints intact."""
    data = ChosenRewards(**vars(task), flat=frozenset(range(len(task.train))))
    with pytest.raises(ValueError, match=r"^rl.dynamic_sampling: 2 steps in a row \(up to "
                                         r"step 2\) found no group"):
        loop.run(_cfg(steps=4, max_consecutive_skips=2), str(tmp_path), data=data,
                 progress=False)
    rows = read_metrics(str(tmp_path))
    assert [r["dynamic/filled_frac"] for r in rows[1:]] == [0.0, 0.0]


@pytest.mark.parametrize("rounds", [0, -1, 2.5, True])
def test_a_round_count_below_one_is_refused_in_one_line(rounds):
    with pytest.raises(ConfigError) as e:
        RLConfig(dynamic_sampling=True, max_sampling_rounds=rounds)
    msg = str(e.value)
    assert msg.startswith("max_sampling_rounds: must be an int >= 1") and "\n" not in msg
    assert f"got {rounds!r}" in msg


@pytest.mark.parametrize("other, needle", [
    ({"max_staleness": 1}, "set rl.max_staleness=0 or rl.dynamic_sampling=false"),
    ({"offline_rollouts": "r.npz"}, "set rl.offline_rollouts='' or rl.dynamic_sampling=false"),
])
def test_dynamic_sampling_with_partial_or_offline_rollouts_is_refused(other, needle):
    with pytest.raises(ConfigError, match="dynamic_sampling: ") as e:
        RLConfig(dynamic_sampling=True, **other)
    assert needle in str(e.value) and "\n" not in str(e.value)
    RLConfig(dynamic_sampling=False, **other)  # each alone is fine

"""Partial rollouts (rl/inflight.py): the staleness bound, the async monitors, exact resume
with the carried queue, both answers to which policy is π_old, and bad settings."""
import numpy as np
import pytest
from rl_helpers import tiny_cfg, versions_and_rollout

from stablerl_jax.config import ConfigError
from stablerl_jax.rl import loop
from stablerl_jax.rl.inflight import EMPTY, Inflight, age_of_tokens, age_stats
from stablerl_jax.runs.metrics_io import outcome, read_metrics


def _cfg(steps=4, staleness=1, **rl):
    cfg = tiny_cfg(steps=steps, checkpoint_every=2, eval_every=2, max_staleness=staleness,
                   **rl)
    # 4 slots for 8 responses per step: 12 in flight, so responses carry over.
    return cfg.replace(sampling=cfg.sampling.replace(max_batch=4))


@pytest.mark.parametrize("old_policy", [pytest.param("behavior", marks=pytest.mark.integration),
                                        pytest.param("proximal", marks=pytest.mark.slow)])
def test_partial_rollouts_stay_within_the_bound_and_resume_exactly(tmp_path, old_policy):
    cfg = _cfg(old_policy=old_policy)
    full = str(tmp_path / "full")
    loop.run(cfg, full, progress=False)
    rows = read_metrics(full)[1:]
    for r in rows:
        assert 0 <= r["async/staleness_max"] <= 1
        assert r["async/age_0_frac"] + r["async/age_1_frac"] == pytest.approx(1)
        assert np.isfinite(r["loss"]) and r["async/decode_steps"] > 0
    assert max(r["async/staleness_max"] for r in rows) == 1, "some tokens are a step old"
    comp = read_metrics(f"{full}/minibatches.jsonl")
    assert all(len(c["prompts"]) == cfg.rl.prompts_per_step for c in comp)
    # Stop after 2 steps, resume to 4: the same metrics, compositions and samples (the
    # carried queue and the past versions are in the checkpoint).
    part = str(tmp_path / "part")
    loop.run(_cfg(steps=2, old_policy=old_policy), part, progress=False)
    loop.run(cfg, part, progress=False)
    assert outcome(read_metrics(part)) == outcome(read_metrics(full))
    assert read_metrics(f"{part}/minibatches.jsonl") == comp


def test_stale_responses_are_dropped_and_redrawn_with_a_new_key():
    cfg = _cfg(staleness=1)
    inf = Inflight.create(cfg, pad_id=0)
    inf.group_ids[:] = np.arange(len(inf.group_ids))
    q = inf.queue
    q.version_IxS[:, 20] = -1
    q.version_IxS[0, 20], q.version_IxS[1, 20] = 3, 4   # 2 and 1 versions old at step 5
    q.completion_IxS[:2, 20] = True
    q.finished_I[:] = True
    keys_before = q.keys_Ix2.copy()

    class Data:  # the queue is full: prepare draws no new prompt
        pass

    assert inf.prepare(5, cfg, Data(), pad_id=0) == 1
    assert inf.dropped == 1 and inf.attempts_I[0] == 1 and inf.attempts_I[1] == 0
    assert not inf.queue.completion_IxS[0].any() and inf.queue.completion_IxS[1, 20]
    assert not inf.queue.finished_I[0] and (inf.queue.version_IxS[0] == -1).all()
    assert not np.array_equal(inf.queue.keys_Ix2[0], keys_before[0])
    assert inf.group_ids[0] == 0 and (inf.group_ids != EMPTY).all()


def test_age_monitors_by_hand():
    version = np.array([[-1, 3, 4, -1], [-1, 4, 4, 4]])
    comp = version >= 0
    stats = age_stats(version, comp, 4, 2)
    assert stats["async/staleness_mean"] == pytest.approx(1 / 5)
    assert stats["async/staleness_max"] == 1
    assert (stats["async/age_0_frac"], stats["async/age_1_frac"],
            stats["async/age_2_frac"]) == (pytest.approx(0.8), pytest.approx(0.2), 0.0)
    np.testing.assert_array_equal(age_of_tokens(version, comp, 4),
                                  [[1, 1, 0, 1], [0, 0, 0, 0]])


@pytest.mark.parametrize("override, field", [
    (dict(max_staleness=-1), "max_staleness"),
    (dict(max_staleness=1, offline_rollouts="x.npz"), "max_staleness"),
    (dict(max_staleness=1, old_policy="latest"), "old_policy"),
])
def test_bad_partial_rollout_settings_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        tiny_cfg(**override)


def _wide(staleness=2, steps=4):
    """2B slots: 3B responses in flight, so each step ends sooner."""
    cfg = _cfg(steps=steps, staleness=staleness)
    b = cfg.rl.prompts_per_step * cfg.rl.group_size
    return cfg.replace(sampling=cfg.sampling.replace(max_batch=2 * b)), b


def test_partial_rollouts_may_have_more_slots_than_a_step_has_responses():
    cfg, b = _wide()
    assert len(Inflight.create(cfg, pad_id=0).attempts_I) == 3 * b
    with pytest.raises(ConfigError, match="sampling.max_batch.*must divide"):
        cfg.replace(rl=cfg.rl.replace(max_staleness=0))   # static and S = 0 samplers


@pytest.mark.slow
def test_a_run_over_more_slots_than_responses_stays_within_the_bound(tmp_path):
    cfg, _ = _wide()
    loop.run(cfg, str(tmp_path), progress=False)
    rows = read_metrics(str(tmp_path))[1:]
    assert all(0 <= r["async/staleness_max"] <= 2 and np.isfinite(r["loss"]) for r in rows)
    assert max(r["async/staleness_max"] for r in rows) >= 1


def test_slots_must_hold_whole_groups():
    cfg = tiny_cfg(max_staleness=1)
    with pytest.raises(ConfigError, match="sampling.max_batch"):
        cfg.replace(sampling=cfg.sampling.replace(max_batch=3),
                    rl=cfg.rl.replace(prompts_per_step=3))


def test_behavior_score_takes_each_tokens_pi_old_from_its_version():
    # step_fns.score with (θ_k, θ_k−1, θ_k−2) and per-token ages equals, token by token,
    # the one-version score at that token's parameters; a version no token has is skipped.
    import jax.numpy as jnp

    from stablerl_jax.rl import step_fns

    cfg = tiny_cfg(max_staleness=2)
    # Ages 0 and 1 only: half of each row's tokens a version old; none two.
    params, r, age = versions_and_rollout(cfg)
    comp = np.asarray(r.completion_mask_BxS)
    rewards = jnp.arange(8, dtype=jnp.float32) % 2
    got, _ = step_fns.score(tuple(params), r, rewards, cfg=cfg, age_BxS=jnp.asarray(age))
    for a in (0, 1):
        want, _ = step_fns.score(params[a], r, rewards, cfg=cfg)
        mine = (age[:, 1:] == a) & comp[:, 1:]
        np.testing.assert_array_equal(np.asarray(got.old_logp_BxT)[mine],
                                      np.asarray(want.old_logp_BxT)[mine])
    assert mine.any()

"""The global-step loop end to end: metrics, optimizer steps, checkpoints, exact resume."""
import json

import jax
import numpy as np
import pytest
from rl_helpers import EOS_ID, PAD_ID, responses_from_rollout, tiny_cfg

from stablerl_jax.rl import loop
from stablerl_jax.rl.engine import Engine
from stablerl_jax.runs.checkpoint import Checkpointer
from stablerl_jax.runs.metrics_io import outcome, read_metrics


def _final_state(cfg, workdir):
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    like = eng.init_state(jax.tree.map(np.zeros_like, _params_like(cfg)))
    state, meta = Checkpointer(f"{workdir}/checkpoints").restore(None, like._asdict())
    return state, meta


def _params_like(cfg):
    from stablerl_jax.model import transformer as tf
    return tf.init_params(jax.random.key(0), cfg.model)


@pytest.mark.integration
def test_few_steps_end_to_end_and_exact_resume(tmp_path):
    cfg = tiny_cfg(steps=4, checkpoint_every=2, eval_every=2)
    full = str(tmp_path / "full")
    summary = loop.run(cfg, full, progress=False)
    rows = read_metrics(full)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for r in rows[1:]:
        assert all(v is None or np.isfinite(v) for v in r.values())
    assert rows[2]["eval/accuracy"] is not None and rows[1].get("eval/accuracy") is None
    state, meta = _final_state(cfg, full)
    assert meta["step"] == 4
    assert int(state["step"]) == 4 * cfg.rl.num_minibatches  # N optimizer steps per step
    assert summary["steps"] == 4 and (tmp_path / "full" / "plots" / "reward.png").exists()
    assert json.loads((tmp_path / "full" / "summary.json").read_text()) == summary

    # Stop after 2 steps, then resume to 4 in the same workdir: identical run.
    part = str(tmp_path / "part")
    loop.run(tiny_cfg(steps=2, checkpoint_every=2, eval_every=2), part, progress=False)
    with open(f"{part}/metrics.jsonl", "a") as f:  # a row written after the checkpoint
        f.write(json.dumps({"step": 3, "reward": 123.0}) + "\n")
    loop.run(cfg, part, progress=False)
    assert outcome(read_metrics(part)) == outcome(rows)
    # Mini-batch composition: one row per step, seeded, identical after the resume.
    comp = read_metrics(f"{full}/minibatches.jsonl")
    assert read_metrics(f"{part}/minibatches.jsonl") == comp
    assert [c["step"] for c in comp] == [1, 2, 3, 4]
    responses = cfg.rl.prompts_per_step * cfg.rl.group_size
    for c in comp:
        assert len(c["prompts"]) == cfg.rl.prompts_per_step
        assert len(c["minibatches"]) == cfg.rl.num_minibatches
        assert sorted(sum(c["minibatches"], [])) == list(range(responses))
    assert comp[0]["minibatches"] != comp[1]["minibatches"]
    # Decoded samples at every eval (steps 0, 2, 4), cut back on resume like the metrics.
    samples = read_metrics(f"{full}/samples.jsonl")
    assert read_metrics(f"{part}/samples.jsonl") == samples
    assert [s["step"] for s in samples] == [0] * 4 + [2] * 4 + [4] * 4
    assert {s["split"] for s in samples} == {"eval/test"}
    assert rows[2]["eval/test/avg@k"] == rows[2]["eval/accuracy"]
    assert summary["accuracy_gain"] == loop.accuracy_gain(rows[0], rows[4])
    assert 0 <= rows[1]["response/truncated_frac"] <= rows[1]["response/clip_ratio"] <= 1
    resumed, _ = _final_state(cfg, part)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 resumed, state)


def test_the_gain_interval_adds_both_evaluations_errors():
    first = {"eval/accuracy": 0.30, "eval/accuracy_stderr": 0.03}
    last = {"eval/accuracy": 0.45, "eval/accuracy_stderr": 0.04}
    got = loop.accuracy_gain(first, last)
    # 1.96 · sqrt(0.03² + 0.04²) = 1.96 · 0.05 (float64 throughout: a few ulps).
    assert got["gain"] == pytest.approx(0.15, abs=1e-15)
    np.testing.assert_allclose(got["interval_95"], [0.15 - 0.098, 0.15 + 0.098], atol=1e-15)
    assert loop.accuracy_gain(first, first) is None  # one evaluation: no gain
    assert loop.accuracy_gain({"eval/accuracy": 0.3}, last) is None  # a row without its error


def test_invalid_workdir_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        loop.run(tiny_cfg(), str(f), progress=False)


@pytest.mark.integration
def test_a_diverging_run_stops_with_an_error(tmp_path):
    # Every update overflows (lr 1e39 is inf in float32) and is skipped: after
    # max_consecutive_skips of them the run raises instead of exiting as if it trained.
    # The config refuses that lr (config/checks.py); set past it, as a diverging run
    # reaches the same state, to test the loop's own guard.
    cfg = tiny_cfg(steps=3, max_consecutive_skips=2)
    object.__setattr__(cfg.rl.optim, "learning_rate", 1e39)
    with pytest.raises(FloatingPointError, match="2 updates in a row"):
        loop.run(cfg, str(tmp_path / "run"), progress=False)
    rows = read_metrics(str(tmp_path / "run"))
    assert rows[-1]["step"] == 1 and rows[-1]["skipped_updates"] == 1.0


@pytest.mark.integration
def test_a_run_trains_on_an_offline_rollout_file(tmp_path):
    """rl.offline_rollouts: the global step reads its responses (tokens, logp_mu, routes,
    weights, rewards) from the file instead of sampling; R3 with weight replay on."""
    import jax.numpy as jnp

    from stablerl_jax.interop.rollouts import write_rollouts
    cfg = tiny_cfg(steps=1, replay="r3", replay_weights=True, eval_every=1)
    params = _params_like(cfg)
    prompts = jax.random.randint(jax.random.key(1), (8, 16), 4, 60)
    ro = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID).sample(
        params, prompts, jnp.ones((8, 16), bool), jax.random.key(2))
    path = str(tmp_path / "rollouts.npz")
    write_rollouts(path, responses_from_rollout(ro, np.arange(8) % 2), group_size=2)
    cfg = cfg.replace(rl=cfg.rl.replace(offline_rollouts=path))
    summary = loop.run(cfg, str(tmp_path / "run"), init_params=params, progress=False)
    assert summary["steps"] == 1 and summary["skipped_updates"] == 0
    row = read_metrics(str(tmp_path / "run"))[1]
    assert row["reward"] == 0.5  # the file's rewards, not the task's
    assert row["routing/mismatch_rate"] == 0.0  # π_old replayed the file's routes
    comp = read_metrics(str(tmp_path / "run" / "minibatches.jsonl"))[0]
    assert comp["responses"] == list(range(8))
    with pytest.raises(ValueError, match="lower rl.steps to 1"):
        loop.run(cfg.replace(rl=cfg.rl.replace(steps=2)), str(tmp_path / "run2"),
                 init_params=params, progress=False)


@pytest.mark.integration
def test_a_continuous_sampler_run_is_the_static_sampler_run(tmp_path):
    # sampling.continuous refills finished slots; the responses are the static
    # sampler's bit for bit (tests/sampling/continuous_test.py), so the whole run is the same.
    cfg = tiny_cfg(steps=2)
    runs = {}
    for continuous in (False, True):
        c = cfg.replace(sampling=cfg.sampling.replace(max_batch=4, continuous=continuous))
        loop.run(c, str(tmp_path / str(continuous)), progress=False)
        runs[continuous] = read_metrics(str(tmp_path / str(continuous)))
    assert outcome(runs[True]) == outcome(runs[False])

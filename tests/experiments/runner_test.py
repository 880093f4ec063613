"""experiments/runner.py: the cold start the benchmarks keep, one per set of settings."""
import os

import jax
import numpy as np
import pytest
from rl_helpers import tiny_cfg

from experiments import runner


@pytest.mark.integration  # trains a (two-step) cold start
def test_a_kept_cold_start_is_reused_for_the_same_settings_only(tmp_path, capsys):
    cfg = tiny_cfg()
    _, params = runner.kept_cold_start(cfg, str(tmp_path))
    trained = capsys.readouterr().out
    assert f"cold start: {cfg.sft.steps} SFT steps into {tmp_path}" in trained
    _, again = runner.kept_cold_start(cfg.replace(name="another run"), str(tmp_path))
    reused = capsys.readouterr().out
    assert "cold start: reused from" in reused
    where = lambda out: next(line for line in out.splitlines()
                             if line.startswith("cold start:")).split()[-1]
    assert where(trained) == where(reused)  # the same directory
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, again)


def test_the_kept_directory_follows_the_cold_starts_settings_only():
    cfg = tiny_cfg()
    same = [cfg.replace(name="other"), cfg.replace(rl=cfg.rl.replace(steps=9, seed=3)),
            cfg.replace(sampling=cfg.sampling.replace(numerics="exact"))]
    other = [cfg.replace(sft=cfg.sft.replace(steps=3)),
             cfg.replace(task=cfg.task.replace(num_train=65)),
             cfg.replace(model=cfg.model.replace(d_model=64, head_dim=16)),
             cfg.replace(rl=cfg.rl.replace(eval_sets="x:/data/x.jsonl"))]
    here = runner.kept_dir(cfg, "/r")
    assert here.startswith("/r/arithmetic-")
    assert all(runner.kept_dir(c, "/r") == here for c in same)
    assert len({here, *(runner.kept_dir(c, "/r") for c in other)}) == 1 + len(other)
    assert runner.kept_dir(cfg).startswith(runner.COLDSTARTS)


def test_released_programs_give_back_their_code_mappings():
    """Each compiled program holds memory mappings of its code until it is dropped: a
    process that compiles variant after variant keeps them all unless they are released
    (rl/engine.release_programs), and dies at the kernel's vm.max_map_count."""
    import jax.numpy as jnp

    from stablerl_jax.rl import engine

    maps = lambda: len(open("/proc/self/maps").read().splitlines())

    alive = []  # the jitted functions live on, as a module's or an Engine's do

    def compile_64(k):  # 64 programs, none compiled before
        for i in range(64):
            alive.append(jax.jit(lambda x, i=i: jnp.tanh(x * i).sum() + k))
            alive[-1](jnp.ones(3)).block_until_ready()

    compile_64(0)
    engine.release_programs()  # what the first compiles leave for good is now left
    base = maps()
    compile_64(1)
    compile_64(2)
    assert maps() - base >= 2 * 64  # kept: at least one mapping a program
    engine.release_programs()
    released = maps()
    for k in (3, 4, 5):
        compile_64(k)
        engine.release_programs()
    assert maps() - released < 32  # released after each round: nothing accumulates


def test_run_variants_releases_the_programs_after_each_variant(monkeypatch):
    calls = []
    monkeypatch.setattr(runner.loop, "run", lambda cfg, rundir, **kw: calls.append(rundir)
                        or dict.fromkeys(("start_accuracy", "end_accuracy", "start_reward",
                                          "end_reward"), 0.0))
    monkeypatch.setattr(runner, "read_metrics", lambda rundir: [])
    monkeypatch.setattr(runner, "release_programs", lambda: calls.append("release"))
    exp = runner.Experiment(tiny_cfg(), (runner.Variant("a"), runner.Variant("b")),
                            seeds=(0, 1))
    runner.run_variants(exp, "/w", data=None, params=None, progress=False)
    assert calls == ["/w/a/seed0", "/w/a/seed1", "release", "/w/b/seed0", "/w/b/seed1",
                     "release"]

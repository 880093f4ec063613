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

"""The cold start (rl/sft.py): a killed SFT resumes bit for bit from its last checkpoint,
logs every step once, starts from given parameters, and refuses to reuse a cold start
made from another starting point."""
import jax
import numpy as np
import pytest
from rl_helpers import kill_cold_start_at

from stablerl_jax import presets
from stablerl_jax.data import sft_data
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import loop, sft
from stablerl_jax.runs.metrics_io import read_metrics

pytestmark = pytest.mark.integration  # each test trains a cold start

SMALL = ["task.num_train=64", "task.num_test=16", "sft.batch_size=8", "sft.steps=4",
         "sft.checkpoint_every=2"]


@pytest.fixture(scope="module")
def cfg():
    return presets.preset("tiny", SMALL)


def _same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_killed_cold_start_resumes_bit_for_bit(cfg, tmp_path, monkeypatch):
    data = loop.task_data(cfg, str(tmp_path / "a"))
    whole, losses = sft.cold_start(cfg, data, str(tmp_path / "a"), progress=False)
    assert len(losses) == 4 and not (tmp_path / "a" / "sft_run" / "checkpoints").exists()

    real = kill_cold_start_at(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        sft.cold_start(cfg, data, str(tmp_path / "b"), progress=False)
    assert [r["step"] for r in read_metrics(str(tmp_path / "b" / "sft_run"))] == [1, 2, 3]
    monkeypatch.setattr(sft_data, "batches", real)
    resumed, again = sft.cold_start(cfg, data, str(tmp_path / "b"), progress=False)
    assert _same(whole, resumed)
    assert again == losses  # the whole curve: steps 1-2 read back, 3-4 trained again
    assert [r["step"] for r in read_metrics(str(tmp_path / "b" / "sft_run"))] == [1, 2, 3, 4]


def test_from_given_parameters_and_a_changed_start_is_refused(cfg, tmp_path):
    data = loop.task_data(cfg, str(tmp_path))
    start = tf.init_params(jax.random.key(7), cfg.model)
    none = cfg.replace(sft=cfg.sft.replace(steps=0))
    assert sft.cold_start(none, data, str(tmp_path), init_params=lambda: start)[0] is start
    one = cfg.replace(sft=cfg.sft.replace(steps=1))
    tuned, _ = sft.cold_start(one, data, str(tmp_path), init_params=lambda: start,
                              init="ckpt-7", progress=False)
    fresh, _ = sft.train_sft(one, data, progress=False)  # from sft.seed's init instead
    assert not _same(tuned, fresh)
    with pytest.raises(ValueError, match=r"trained with other settings \(init\)"):
        sft.cold_start(one, data, str(tmp_path), init="other", progress=False)

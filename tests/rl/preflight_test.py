"""Every path a run reads or writes besides its workdir goes through the workdir's checks
before any work (rl/preflight.check_urls): a gs:// URL must be valid and its bucket must
answer within storage_gcs.REACH_BOUND_S; one line naming the setting otherwise."""
import socket
import time

import pytest
from cli_helpers import one_line
from rl_helpers import tiny_cfg

from stablerl_jax.config import TaskConfig
from stablerl_jax.rl import preflight
from stablerl_jax.runs import storage_gcs


@pytest.fixture
def unreachable_store(monkeypatch, tmp_path):
    """Every storage client points at a closed local port: no request leaves the
    machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    monkeypatch.chdir(tmp_path)
    return url


def _jsonl(cfg, **task):
    return cfg.replace(task=TaskConfig(kind="gsm8k", max_prompt_len=16, max_solution_len=40,
                                       **task))


# (setting, url -> (config, --hf, --export-hf)) for each setting that takes a path.
CASES = [
    ("task.jsonl_dir", lambda u: (_jsonl(tiny_cfg(), jsonl_dir=u), "", "")),
    ("task.tokenizer_dir", lambda u: (_jsonl(tiny_cfg(), jsonl_dir="/d", tokenizer_dir=u),
                                      "", "")),
    ("rl.eval_sets (aime)", lambda u: (_jsonl(tiny_cfg(eval_sets=f"aime:{u}"),
                                              jsonl_dir="/d"), "", "")),
    ("sft.data", lambda u: (tiny_cfg().replace(sft=tiny_cfg().sft.replace(data=u)), "", "")),
    ("rl.offline_rollouts", lambda u: (tiny_cfg(offline_rollouts=u), "", "")),
    ("--hf", lambda u: (tiny_cfg(), u, "")),
    ("--export-hf", lambda u: (tiny_cfg(), "", u)),
]
SETTINGS = [what for what, _ in CASES]


def _check(i, url):
    """check_urls on case i with `url`."""
    cfg, hf, export = CASES[i][1](url)
    preflight.check_urls(cfg, hf, export)


@pytest.mark.parametrize("i", range(len(SETTINGS)), ids=SETTINGS)
@pytest.mark.parametrize("url, needle", [
    ("gs:///rollouts.npz", "no bucket name"),
    ("gs://my-runs//r.npz", "the object path holds an empty segment"),
    ("s3://my-runs/r.npz", "s3:// is not supported"),
], ids=["no bucket", "empty segment", "another store"])
def test_a_bad_url_of_any_setting_is_one_line_naming_it_before_any_request(
        unreachable_store, i, url, needle):
    t0 = time.monotonic()
    with pytest.raises((ValueError, OSError)) as e:  # both one line at the command line
        _check(i, url)
    assert time.monotonic() - t0 < 1
    assert f"{SETTINGS[i]} {url!r}: {needle}" in str(e.value), str(e.value)


@pytest.mark.parametrize("i", range(len(SETTINGS)), ids=SETTINGS)
def test_a_store_that_does_not_answer_is_one_line_naming_the_setting_within_the_bound(
        unreachable_store, monkeypatch, i):
    # The bound shortened to keep the default tier fast; the real one through the command
    # line: test_an_offline_file_in_an_unreachable_bucket_is_refused_like_a_workdir.
    monkeypatch.setattr(storage_gcs, "REACH_DEADLINE_S", 0.5)
    monkeypatch.setattr(storage_gcs, "REACH_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as e:
        _check(i, "gs://my-runs/there")
    assert time.monotonic() - t0 < 1 + 5  # the slack: a busy machine
    assert f"{SETTINGS[i]} 'gs://my-runs/there': no answer from the storage emulator at " \
           f"{unreachable_store}" in str(e.value), str(e.value)


def test_local_paths_ask_nothing(unreachable_store):
    for i in range(len(CASES)):
        _check(i, "/data/somewhere")


@pytest.mark.integration
def test_an_offline_file_in_an_unreachable_bucket_is_refused_like_a_workdir(
        capsys, tmp_path, unreachable_store):
    t0 = time.monotonic()
    one_line(capsys, ["--workdir", str(tmp_path / "run"), "--quiet", "--compile-cache=",
                      "rl.offline_rollouts=gs://my-runs/rollouts.npz"],
             "rl.offline_rollouts 'gs://my-runs/rollouts.npz': no answer from the storage "
             f"emulator at {unreachable_store} (STORAGE_EMULATOR_HOST) within "
             f"{storage_gcs.REACH_BOUND_S:g} s")
    assert time.monotonic() - t0 < storage_gcs.REACH_BOUND_S + 10
    assert not (tmp_path / "run").exists()

"""Property-based fuzzing of the input surfaces a user hands the program as settings:
the config (`key=value` overrides, the Engine each accepted tiny config builds, and the
stored config a resumed run compares), `gs://` URLs and the trackers' environment
variables; the files a run reads are fuzzed in tests/fuzz_files_test.py. Each input
either works or raises a user error, which the command line prints as one line
(tests/fuzz_helpers.py), within a bound on its time; and what works holds what the input
said: no value silently changed type, rounded, wrapped or dropped.

Every surface runs under the FAST profile in the default suite (60 derandomized examples
each) and under LONG with `pytest -m slow` (2,000 fresh examples each); the times are in
docs/records/reliability.md. The library functions are called in-process. Inputs found
to break the property become table cases in the bad-input tables
(tests/bad_input_test.py, tests/bad_file_input_test.py,
tests/interop/bad_hf_input_test.py; through the command line where the surface is
reachable from it); those whose fix is still open are listed in fuzz_helpers.OPEN.
"""
from __future__ import annotations

import os

import mlflow  # noqa: F401  (its first import runs `uname -p`: here, not in a test)
import pytest
from fuzz_helpers import (
    FAST,
    JSON,
    LONG,
    PROFILES,
    REFUSED,
    mutated_json_object,
    pass_over_open,
    run,
    works_or_user_error,
)
from hypothesis import strategies as st

from stablerl_jax import presets
from stablerl_jax.config import flat_dict
from stablerl_jax.config.checks import fits_float32
from stablerl_jax.rl import preflight
from stablerl_jax.rl.engine import Engine

# -- the config: key=value overrides --------------------------------------------------

TINY_FIELDS = flat_dict(presets.tiny())
EDGY_VALUES = ["nan", "inf", "-inf", "1e309", "-0", "0", "-1", "2147483648", "1.5", "1e3",
               "0x10", "1_000", " 5 ", "٣", "５", "true", "True", "yes", "", "none", "None",
               "1,2", "(1,2,3)", "1,,1,1", "1,1,1,", "2,2,2", "a,b,c", "=", "\x00",
               # int32 / int64 limits, float32's, and values just past them
               "2147483647", "-2147483648", "-2147483649", "9223372036854775807",
               "-9223372036854775808", "9223372036854775808", "3.4028234e38", "3.5e38",
               "1e-45", "1e-38", "-1e-300", "1e300", "65536", "1048576", "4096"]


def _values_like(default):
    """Strings a user might write for a field whose value is `default`'s type."""
    if isinstance(default, bool):
        return st.sampled_from(["true", "false", "1", "0", "yes", "TRUE", " true "])
    if isinstance(default, int):
        return st.integers(-(2 ** 40), 2 ** 40).map(str)
    if isinstance(default, float):
        return st.floats().map(repr)
    if isinstance(default, list):  # a tuple field: ints, some entries left empty
        entry = st.sampled_from(["1", "2", "", " ", "x"]) | st.integers(-2, 2 ** 33).map(str)
        return st.lists(entry, max_size=4).map(",".join)
    return st.text(max_size=10)


def _override(key):
    typed = _values_like(TINY_FIELDS[key]) if key in TINY_FIELDS else st.nothing()
    value = typed | st.sampled_from(EDGY_VALUES) | st.text(max_size=10)
    return value.map(lambda v: f"{key}={v}")


OVERRIDES = st.lists((st.sampled_from(sorted(TINY_FIELDS)) | st.text(max_size=12)).flatmap(
    _override) | st.text(max_size=16), max_size=4)


def _ints(parts) -> list | None:
    try:
        return [int(p) for p in parts]
    except ValueError:
        return None


def _check_overrides(workdir, example):
    pass_over_open("overrides", example)
    name, overrides = example
    cfg = works_or_user_error(presets.preset, name, overrides)
    if cfg is REFUSED:
        return
    if name == "tiny":  # what a run does before its first step: this machine's checks,
        # then the Engine's mesh, shardings and steps (an accepted config must build)
        if works_or_user_error(preflight.check_run, cfg, workdir) is not REFUSED:
            works_or_user_error(Engine.create, cfg, eos_id=3, pad_id=0)
    before, after = flat_dict(presets.EXPERIMENT_PRESETS[name]()), flat_dict(cfg)
    last = {}
    for item in overrides:  # the value each field ends with: its last override
        key, _, value = item.partition("=")
        last[key.strip()] = value
    for key, value in last.items():
        was, got = before[key], after[key]
        assert type(got) is type(was) or (was is None and isinstance(got, str)), (key, got)
        low = value.strip().lower()
        if isinstance(got, bool):
            assert low in ("true", "false", "1", "0") and got == (low in ("true", "1"))
        elif isinstance(got, int):
            assert got == int(value), (key, value, got)
        elif isinstance(got, float):  # as written, and a number a run can use: finite
            # in float32, the dtype every float setting is computed in
            assert fits_float32(got) and got == float(value), (key, value, got)
        elif isinstance(got, list):  # a tuple field: each written entry an int
            parts = value.strip().strip("()").split(",")
            parts = parts[:-1] if len(parts) > 1 and not parts[-1].strip() else parts
            assert got == _ints(parts), (key, value, got)


@pytest.mark.parametrize("profile", PROFILES)
def test_config_overrides(profile, tmp_path):
    presets_ = st.sampled_from(["tiny", "long", "moe1b"]) | st.text(max_size=6)
    workdir = str(tmp_path / "run")
    run(profile, st.tuples(presets_, OVERRIDES), lambda ex: _check_overrides(workdir, ex))
    assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run")


def _check_stored_config(saved):
    pass_over_open("stored config", saved)
    works_or_user_error(preflight.check_resumed_config, saved, presets.tiny(), [], "workdir")


@pytest.mark.parametrize("profile", PROFILES)
def test_stored_config_of_a_resumed_run(profile):
    stored = mutated_json_object(TINY_FIELDS) | JSON
    run(profile, stored, _check_stored_config)


# -- gs:// URLs ------------------------------------------------------------------------

_URL_PARTS = st.sampled_from(["gs://", "gs:/", "gs:", "GS://", "gs:///", " gs://", "s3://",
                              ""])
_NAME = st.text(st.sampled_from("abz09-_.A /\\\n\t:%?#*goog"), max_size=70) | st.sampled_from(
    ["my-runs", "a", "ab", "abc", "x" * 63, "x" * 64, "a." * 111 + "b", "192.168.0.1",
     "googbucket", "my-google-runs", "-runs", "runs-", "a..b"])
_PATH = st.lists(st.text(max_size=8) | st.sampled_from([".", "..", "", "run 1", "é"]),
                 max_size=4).map("/".join)


def _check_url(url: str):
    from stablerl_jax.runs import storage_gcs
    if works_or_user_error(storage_gcs.check_url, url, "workdir") is REFUSED:
        return
    if not url.startswith("gs://"):
        return  # not a bucket URL: nothing to hold
    bucket, _, path = url[len("gs://"):].partition("/")
    # What passes names a bucket GCS could hold and an object path it could store.
    assert 3 <= len(bucket) <= 222 and bucket == bucket.lower() and bucket[0].isalnum()
    assert bucket[-1].isalnum() and "//" not in path and ".." not in path.split("/")
    assert not any(ord(c) < 32 for c in path)


@pytest.mark.parametrize("profile", PROFILES)
def test_gs_urls(profile):
    urls = st.tuples(_URL_PARTS, _NAME, st.sampled_from(["", "/"]), _PATH).map("".join)
    run(profile, urls | st.text(max_size=30), _check_url)


# -- the paths of every setting that takes one ------------------------------------------

_SETTINGS = ["task.jsonl_dir", "task.tokenizer_dir", "rl.eval_sets", "sft.data",
             "rl.offline_rollouts", "--hf", "--export-hf"]


def _with_path(setting: str, url: str):
    """(config, --hf, --export-hf) with `url` given to `setting`."""
    cfg = presets.tiny()
    if setting.startswith("--"):
        return cfg, url * (setting == "--hf"), url * (setting == "--export-hf")
    section, field = setting.split(".")
    if section == "task" or setting == "rl.eval_sets":  # the data sets of a math task
        cfg = cfg.replace(task=cfg.task.replace(kind="gsm8k", jsonl_dir="/data"))
    value = f"aime:{url}" if setting == "rl.eval_sets" else url
    return cfg.replace(**{section: getattr(cfg, section).replace(**{field: value})}), "", ""


def _check_setting_url(example):
    from stablerl_jax.runs import storage_gcs
    setting, url = example
    built = works_or_user_error(_with_path, setting, url)
    if built is REFUSED:
        return
    with pytest.MonkeyPatch.context() as mp:  # a closed port, a short bound (real: 15 s)
        mp.setattr(storage_gcs, "REACH_DEADLINE_S", 0.1)
        mp.setattr(storage_gcs, "REACH_TIMEOUT_S", 0.1)
        works_or_user_error(preflight.check_urls, *built)


@pytest.mark.parametrize("profile", [
    pytest.param(FAST.__class__(FAST, max_examples=30), id="fast"),
    pytest.param(LONG.__class__(LONG, max_examples=300), id="long", marks=pytest.mark.slow)])
def test_the_path_of_every_setting(profile, monkeypatch, tmp_path):
    """Each setting that takes a path, given any URL: a local path asks nothing; a gs://
    one is checked as a workdir is, against a store at a closed local port."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{s.getsockname()[1]}")
    monkeypatch.chdir(tmp_path)
    urls = st.tuples(_URL_PARTS, _NAME, st.sampled_from(["", "/"]), _PATH).map("".join)
    run(profile, st.tuples(st.sampled_from(_SETTINGS), urls | st.text(max_size=30)),
        _check_setting_url)


# -- the trackers' environment ------------------------------------------------------------

_MLFLOW_URIS = st.sampled_from([
    "http://127.0.0.1:9", "https://127.0.0.1:9", "http://", "http://[::1", "sqlite://",
    "ftp://127.0.0.1/x", "databricks", "", "  ", "file://", "http://127.0.0.1:notaport",
    "uc:"]) | st.text(st.characters(blacklist_characters="\x00"), max_size=12)
_WANDB_MODES = st.sampled_from(["online", "offline", "disabled", "dryrun", "offlne", "", "ON"])


def _check_tracker_env(workdir: str, example):
    from stablerl_jax.runs.trackers import Trackers
    names, env = example
    with pytest.MonkeyPatch.context() as mp:
        for key in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_BASE_URL"):
            mp.delenv(key, raising=False)
        mp.setenv("WANDB_DIR", workdir)
        mp.setenv("WANDB_DISABLE_GIT", "true")
        mp.setenv("HOME", workdir)  # no netrc, no cached login
        for key, value in env.items():
            mp.setenv(key, value)
        tracker = works_or_user_error(Trackers, names, workdir, run_name="fuzz")
        if tracker is not REFUSED:
            works_or_user_error(tracker.close)


@pytest.mark.parametrize("profile", [
    pytest.param(FAST.__class__(FAST, max_examples=12), id="fast"),
    pytest.param(LONG.__class__(LONG, max_examples=150), id="long",
                 marks=pytest.mark.slow)])
def test_tracker_environment(profile, tmp_path):
    """Tracker names with their environment variables set at random (only the trackers'
    own variables: a closed local port for servers, no network): a tracker opens or the
    run stops in one line, within the bound (hard_timeout), and nothing is written
    outside the workdir."""
    env = st.fixed_dictionaries({}, optional={
        "MLFLOW_TRACKING_URI": _MLFLOW_URIS, "WANDB_MODE": _WANDB_MODES,
        "WANDB_API_KEY": st.sampled_from(["", "x", "0" * 40, "local-" + "0" * 40]),
        "WANDB_BASE_URL": st.sampled_from(["http://127.0.0.1:9", "notaurl", ""])})
    names = st.sampled_from([("mlflow",), ("wandb",), ("wandb", "mlflow")])
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    before = set(os.listdir(tmp_path))
    run(profile, st.tuples(names, env), lambda ex: _check_tracker_env(workdir, ex))
    assert set(os.listdir(tmp_path)) == before  # everything stayed in the workdir

"""Bad `gs://` input at the command line: a URL outside Cloud Storage's naming rules (or a
misspelt one) and a storage endpoint that refuses connections each end in one line on
stderr naming the URL and the fix, with exit status 2, before any work. No emulator runs
here: STORAGE_EMULATOR_HOST names a closed local port, so no request leaves the machine,
and a URL that is refused must be refused before any request."""
import logging
import socket
import time

import pytest

from experiments import train
from stablerl_jax.runs import storage, storage_gcs

# (case, URL, the message must contain this)
BAD_URLS = [
    ("empty bucket", "gs:///run", "no bucket name"),
    ("scheme alone", "gs://", "no bucket name"),
    ("bucket too short", "gs://ab/run", "is not 3-63 characters"),
    ("bucket too long", "gs://" + "a" * 64 + "/run", "is not 3-63 characters"),
    ("uppercase bucket", "gs://My-Runs/run", "lowercase letters"),
    ("bucket ends with a dash", "gs://my-runs-/run", "start and end with a letter or digit"),
    ("bucket starts with a dot", "gs://.my-runs/run", "start and end with a letter or digit"),
    ("space in the bucket", "gs://my runs/run", "lowercase letters"),
    ("empty dotted part", "gs://my..runs/run", "empty dot-separated part"),
    ("IP address bucket", "gs://192.168.5.4/run", "is an IP address"),
    ("reserved bucket", "gs://google-runs/run", "reserves"),
    ("leading whitespace", " gs://my-runs/run", "whitespace around the URL"),
    ("trailing newline", "gs://my-runs/run\n", "whitespace around the URL"),
    ("one slash", "gs:/my-runs/run", "starts with gs:// (two slashes)"),
    ("no slash", "gs:my-runs/run", "starts with gs:// (two slashes)"),
    ("double slash inside", "gs://my-runs/a//run", "double slash"),
    ("double slash after the bucket", "gs://my-runs//run", "double slash"),
    ("newline in the object name", "gs://my-runs/ru\nn", "control character '\\n'"),
    ("carriage return in the object name", "gs://my-runs/run\r1", "control character '\\r'"),
    ("tab in the object name", "gs://my-runs/ru\tn", "control character '\\t'"),
    ("dot segment", "gs://my-runs/./run", "'.' or '..' segment"),
    ("dot-dot segment", "gs://my-runs/a/../run", "'.' or '..' segment"),
    ("object name too long", "gs://my-runs/" + "x" * 1100, "over Cloud Storage's 1024"),
]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def unreachable_store(monkeypatch, tmp_path):
    """Every storage client points at a closed local port; a misspelt URL that would be
    a local path lands under tmp_path. Yields the endpoint."""
    url = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    monkeypatch.chdir(tmp_path)
    yield url


def _one_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("case, url, needle", BAD_URLS, ids=[c[0] for c in BAD_URLS])
def test_a_bad_gs_workdir_is_one_line_naming_it_and_a_good_one(capsys, tmp_path, case, url,
                                                               needle):
    t0 = time.monotonic()
    err = _one_line(capsys, ["--workdir", url, "--quiet", "--compile-cache="])
    assert time.monotonic() - t0 < 5, "refused before any request"
    assert f"workdir {url!r}" in err and needle in err, (case, err)
    assert "gs://my-runs/" in err, err  # an example of a good URL
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_bad_gs_checkpoint_is_one_line_naming_it(capsys, tmp_path):
    err = _one_line(capsys, ["--workdir", str(tmp_path / "run"), "--quiet",
                             "--compile-cache=", "--hf", "gs:///Qwen3-30B-A3B-Base"])
    assert "'gs:///Qwen3-30B-A3B-Base': no bucket name" in err, err


@pytest.mark.parametrize("fn", [storage.abspath, storage.fetch_dir, storage.makedirs,
                                storage.exists, storage.local_dir, storage.open_file])
def test_storage_refuses_a_bad_gs_url_where_it_enters(fn):
    with pytest.raises(storage_gcs.BadURL, match="'gs://my-runs//run': the object path holds "
                                             "an empty segment"):
        fn("gs://my-runs//run")


def test_an_endpoint_refusing_connections_is_one_line_within_the_bound(
        capsys, caplog, unreachable_store):
    caplog.set_level(logging.DEBUG)
    t0 = time.monotonic()
    err = _one_line(capsys, ["--workdir", "gs://my-runs/run1", "--quiet", "--compile-cache="])
    took = time.monotonic() - t0
    # The libraries' records of the retried requests (urllib3's "Retrying", tracebacks)
    # never reach a handler, the terminal's included.
    libraries = ("urllib3", "google", "gcsfs", "fsspec", "aiohttp")
    noisy = [r for r in caplog.records if r.name.startswith(libraries) or r.exc_info]
    assert not noisy, [(r.name, r.getMessage()[:100]) for r in noisy]
    assert took < storage_gcs.REACH_BOUND_S + 10, took  # the slack: a busy machine
    assert (f"workdir 'gs://my-runs/run1': no answer from the storage emulator at "
            f"{unreachable_store} (STORAGE_EMULATOR_HOST) within "
            f"{storage_gcs.REACH_BOUND_S:g} s (Connection refused)") in err, err
    assert "fix or unset STORAGE_EMULATOR_HOST" in err, err

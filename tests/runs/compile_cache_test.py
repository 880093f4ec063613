"""The entry points' persistent compilation cache: a compiled program lands in the
directory and a second process loads it instead of compiling; '' leaves it off."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # each test starts Python processes

PROGRAM = """
import sys, jax, jax.numpy as jnp
from stablerl_jax.runs import compile_cache
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
compile_cache.enable(sys.argv[1])
jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(7.0)).block_until_ready()
print("hits", len(hits))
"""


def _run(path) -> int:
    """Cache hits of the process that compiles the program."""
    out = subprocess.run([sys.executable, "-c", PROGRAM, path], check=True, timeout=120,
                         capture_output=True, text=True).stdout
    return int(out.split("hits")[-1])


def test_programs_persist_across_processes(tmp_path):
    cache = tmp_path / "xla"
    assert _run(str(cache)) == 0
    entries = sorted(p.name for p in cache.iterdir())
    assert entries, "nothing was written to the cache"
    assert _run(str(cache)) >= 1  # loaded, not compiled
    assert sorted(p.name for p in cache.iterdir()) == entries


def test_empty_path_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _run("") == 0
    assert not any(tmp_path.iterdir())

"""The commands' old `python -m` names (stablerl_jax.sampling.bitwise_check,
stablerl_jax.interop.parity) still run the commands, now in experiments/, with one note on
stderr; away from the repository root, where experiments/ is not importable, they say
where the command went and exit 2."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
OLD = {"stablerl_jax.sampling.bitwise_check": (["--rows", "0"], "--rows"),
       "stablerl_jax.interop.parity": ([], "usage")}


@pytest.mark.integration
@pytest.mark.parametrize("old", sorted(OLD))
def test_an_old_command_name_runs_the_command_with_a_note(old, tmp_path):
    args, says = OLD[old]
    new = "experiments." + old.rsplit(".", 1)[1]
    here = subprocess.run([sys.executable, "-m", old, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    # Both bad command lines: the command's own status 2 and its own line, after the note.
    assert here.returncode == 2, here.stderr[-2000:]
    assert here.stderr.startswith(f"note: {old} is now {new}")
    assert says in here.stderr
    away = subprocess.run([sys.executable, "-m", old, *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert away.returncode == 2
    assert away.stderr.strip() == (f"{old} is now {new}: run `python -m {new}` from the "
                                   "repository root")

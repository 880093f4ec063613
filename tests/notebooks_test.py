"""The notebooks run headless, top to bottom, as a researcher would run them; each one
asserts its own checks (an AssertionError in a cell fails the test)."""
import os
import pathlib

import jupytext
import nbclient
import pytest
from rl_helpers import tiny_cfg

from stablerl_jax.rl import loop

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def _execute(name: str, cwd, env=None):
    nb = jupytext.reads((NOTEBOOKS / f"{name}.py").read_text(), fmt="py:percent")
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def _outputs(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))


@pytest.mark.parametrize("name, expected", [
    ("losses", "on-policy MiniRL token weights == Â / B"),
    ("routing_mismatch", "replay=r3"),
])
def test_notebook_runs(tmp_path, name, expected):
    nb = _execute(name, tmp_path)
    assert expected in _outputs(nb)


def test_run_analysis_on_a_real_run(tmp_path):
    workdir = tmp_path / "run"
    loop.run(tiny_cfg(steps=2, eval_every=2), str(workdir), progress=False)
    nb = _execute("run_analysis", tmp_path, {"STABLERL_WORKDIR": str(workdir)})
    out = _outputs(nb)
    assert "3 rows, steps 0..2" in out and "held-out accuracy by step: 0:" in out
    assert (tmp_path / "run_analysis.png").exists()

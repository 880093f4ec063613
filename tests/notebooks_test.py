"""The notebooks run headless, top to bottom, as a researcher would run them. Each one
asserts its own checks on the library's results (an AssertionError in a cell fails the
test); here we also check what they print and that their figures were rendered."""
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


def _outputs(nb) -> tuple[str, int]:
    """All printed text, and the number of images the notebook displayed."""
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outs)
    return text, sum("image/png" in o.get("data", {}) for o in outs)


@pytest.mark.parametrize("name, expected, images", [
    pytest.param("losses", ["on-policy MiniRL token weights == Â / B",
                            "diagnostics.clip_fractions says"], 4,
                 marks=pytest.mark.integration),
    # ~60 s; the library it is a client of runs in tests/method/mismatch_test.py and
    # tests/method/diagnostics_test.py. `pytest -m slow` runs it.
    pytest.param("routing_mismatch", ["replay=r3 shrinks the engine factor", "fp8   KL k1 +"],
                 2, marks=pytest.mark.slow),
])
def test_notebook_runs(tmp_path, name, expected, images):
    text, n_images = _outputs(_execute(name, tmp_path))
    for line in expected:
        assert line in text
    assert n_images == images


@pytest.mark.slow  # trains a 2-step run first (~2 min on 2 cores)
def test_run_analysis_on_a_real_run(tmp_path):
    workdir = tmp_path / "run"
    loop.run(tiny_cfg(steps=2, eval_every=2), str(workdir), progress=False)
    nb = _execute("run_analysis", tmp_path, {"STABLERL_WORKDIR": str(workdir)})
    text, n_images = _outputs(nb)
    assert "3 rows, steps 0..2" in text
    assert "run: held-out accuracy by step: 0: " in text and ", 2: " in text
    assert (tmp_path / "run_analysis.png").exists()
    assert n_images == 2  # the panel grid and the reward curve, both shown inline

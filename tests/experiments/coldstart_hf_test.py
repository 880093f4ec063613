"""The cold-start experiment from a checkpoint (marker `interop`: transformers and torch
build it): `experiments.coldstart --preset paper --hf DIR --sft-data long:…,short:…` on a
tiny random Qwen3MoeForCausalLM (tests/hf_fixtures.py), scaled down on the command line.

Checked: one variant per named data file, each with its own cold start from the
checkpoint (its settings name its file and the checkpoint), the RL runs from each, the
report naming both; the two cold starts differ. Bad `--sft-data` values are one-line
errors that name the flag, and a directory holding train.jsonl is accepted, as
`sft.data` accepts it; `--dry-run` prints the checkpoint's architecture.
"""
import json
import shutil

import jax
import numpy as np
import pytest
from coldstart_recipe_test import BASE
from hf_fixtures import write_jsonl, write_recipe_dirs

pytest.importorskip("torch", reason="the interop extra (torch) is not installed")
pytest.importorskip("transformers", reason="the interop extra (transformers) is not installed")

from experiments import coldstart  # noqa: E402
from stablerl_jax.runs.checkpoint import load_params  # noqa: E402
from stablerl_jax.runs.metrics_io import read_metrics  # noqa: E402

pytestmark = pytest.mark.interop

# The paper preset's coldstart experiment is a pod job: one prompt per mini-batch (N = 2),
# a few SFT steps of 4 examples.
SFT = ["sft.steps=4", "sft.batch_size=4", "sft.checkpoint_every=4",
       "sft.optim.learning_rate=3e-3", "sft.optim.warmup_frac=0.0"]
PAIRS = [(3, 4), (12, 7), (2, 2), (5, 6)]


def _chat(a, b, thinking: bool) -> dict:
    think = f"{a} + {b} = {a + b}" if thinking else ""
    return {"messages": [
        {"role": "user", "content": f"What is {a} + {b}?"},
        {"role": "assistant", "content": f"<think>\n{think}\n</think>\n\n"
                                         f"The answer is $\\boxed{{{a + b}}}$."}]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("coldstart_hf")
    ckpt, data, _ = write_recipe_dirs(root, PAIRS)
    files = {"long": write_jsonl(root / "long.jsonl", [_chat(a, b, True) for a, b in PAIRS]),
             "short": write_jsonl(root / "short.jsonl", [_chat(a, b, False) for a, b in PAIRS])}
    return {"root": root, "ckpt": str(ckpt), "files": files,
            "over": [*BASE, f"task.jsonl_dir={data}", *SFT]}


@pytest.mark.slow  # two cold starts and two RL runs: about 80 s
def test_one_cold_start_per_data_file_then_the_recipe(setup):
    work, files = setup["root"] / "runs", setup["files"]
    runs = coldstart.main(["--preset", "paper", "--hf", setup["ckpt"], "--sft-data",
                           f"long:{files['long']},short:{files['short']}", "--workdir",
                           str(work), "--seeds", "0", "--quiet", "--compile-cache=",
                           *setup["over"], "rl.steps=2"])
    assert list(runs) == ["sft-long", "sft-short"]
    for name, path in files.items():
        settings = json.loads((work / f"sft-{name}" / "sft.json").read_text())
        assert settings["sft.data"] == path and settings["init"] == setup["ckpt"]
        sft_rows = read_metrics(str(work / f"sft-{name}" / "sft_run"))
        assert [r["step"] for r in sft_rows] == [1, 2, 3, 4]
        (records,) = runs[f"sft-{name}"]
        assert [r["step"] for r in records] == [0, 1, 2]
        assert np.isfinite(records[-1]["reward"])
    rows = json.loads((work / "summary.json").read_text())["variants"]
    assert [r["variant"] for r in rows] == ["sft-long", "sft-short"]
    table = (work / "summary.md").read_text()
    assert "sft-long" in table and "sft-short" in table
    long, short = (load_params(str(work / f"sft-{n}" / "sft")) for n in files)
    assert jax.tree.structure(long) == jax.tree.structure(short)
    assert any(not np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(long), jax.tree.leaves(short)))


def test_dry_run_shows_the_checkpoint_architecture(setup, capsys):
    files = setup["files"]
    coldstart.main(["--preset", "paper", "--hf", setup["ckpt"], "--sft-data",
                    f"long:{files['long']}", "--dry-run", *setup["over"]])
    out = capsys.readouterr().out
    assert out.startswith("sft-long (seeds [0, 1, 2])") and f"sft.data={files['long']}" in out
    assert f"L=2 D=64 E=8 K=2 V=512 compute=float32 from {setup['ckpt']}" in out


def test_sft_data_may_name_a_directory_as_sft_data_does(setup, tmp_path, capsys):
    # A directory holding train.jsonl (or train.parquet) is what sft.data reads too.
    shutil.copyfile(setup["files"]["short"], tmp_path / "train.jsonl")
    coldstart.main(["--preset", "paper", "--hf", setup["ckpt"], "--sft-data",
                    f"short:{tmp_path}", "--dry-run", *setup["over"]])
    assert f"sft.data={tmp_path}" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["nocolon", "a:/no/such/file.jsonl", "a b:{long}",
                                   "a:{long},a:{long}"])
def test_bad_sft_data_is_a_one_line_error(setup, capsys, value):
    value = value.format(long=setup["files"]["long"])
    with pytest.raises(SystemExit) as e:
        coldstart.main(["--hf", setup["ckpt"], "--sft-data", value, "--dry-run"])
    assert e.value.code == 2
    assert "error: --sft-data: " in capsys.readouterr().err

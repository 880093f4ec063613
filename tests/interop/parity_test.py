"""`python -m experiments.parity` on a tiny Qwen3-MoE checkpoint (marker
`interop`: transformers and torch build and run it). A good checkpoint passes within the
float32 bound; a copy with a square weight (layer 1's o_proj, 64 × 64) transposed in its
safetensors fails against the original (`--reference`), exit status 1 and one line, and
passes alone: transformers and this project read the file the same way, which is why
the original is needed. A loader that reads that weight transposed fails on the good
checkpoint."""
import glob
import os
import shutil
import subprocess
import sys

import pytest
from hf_fixtures import write_qwen3_moe, write_qwen_tokenizer

torch = pytest.importorskip("torch", reason="the interop extra (torch) is not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the interop extra (transformers) is not installed")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from stablerl_jax.interop import hf_checkpoint as hc  # noqa: E402
from experiments import parity  # noqa: E402

pytestmark = pytest.mark.interop
SQUARE = "model.layers.1.self_attn.o_proj.weight"  # hidden 64 = 4 heads × 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("parity") / "ckpt"
    path.mkdir()
    tok = write_qwen_tokenizer(path)
    write_qwen3_moe(path, tok)
    write_qwen_tokenizer(path)  # save_pretrained wrote its own generation_config.json
    return path


def _transposed(src, dest):
    shutil.copytree(src, dest)
    for file in glob.glob(str(dest / "*.safetensors")):
        with safe_open(file, "pt") as f:
            if SQUARE in f.keys():
                tensors = load_file(file)
                assert tensors[SQUARE].shape[0] == tensors[SQUARE].shape[1]
                tensors[SQUARE] = tensors[SQUARE].T.contiguous()
                save_file(tensors, file, metadata={"format": "pt"})
                return dest
    raise AssertionError(f"{SQUARE} not found")


def test_a_good_checkpoint_is_within_the_float32_bound(ckpt, capsys):
    rows = parity.compare(str(ckpt))
    for r in rows:
        assert r["delta"] <= r["bound"], r
        # The bound separates rounding from a wrong weight: ~1e-5 of the logits' scale.
        assert r["bound"] < 1e-4 * r["max_abs_logit"], r
    assert parity.main([str(ckpt)]) == 0
    assert "parity OK" in capsys.readouterr().out


@pytest.mark.integration
def test_a_transposed_square_weight_fails_against_the_original(ckpt, tmp_path):
    bad = _transposed(ckpt, tmp_path / "bad")
    proc = subprocess.run([sys.executable, "-m", "experiments.parity", str(bad),
                           "--reference", str(ckpt)], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          timeout=600)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"parity: FAILED: {bad} vs transformers on "
                                               f"{ckpt}: prompt 0 max |Δlogit|"), err
    assert "a square weight stored transposed" in err[0]
    # Alone, both read the file's transposed weight alike: parity holds.
    assert parity.main([str(bad)]) == 0


def test_a_loader_that_reads_a_square_weight_transposed_fails(ckpt, monkeypatch, capsys):
    read = hc._read

    class Transposed:
        def __init__(self, ts):
            self.full = ts[:, :]

        def __getitem__(self, index):
            return self.full.T[index]

    monkeypatch.setattr(hc, "_read", lambda ts, how, *a: read(
        Transposed(ts) if how == "heads_in" else ts, how, *a))
    assert parity.main([str(ckpt)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "read a weight of it differently" in err[0], err

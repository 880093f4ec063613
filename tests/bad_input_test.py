"""Bad input, one case per row: each is refused with an error that names the field (or
file, line, tensor) and says what to change, and nothing is written. Cases through the
command line run `experiments.quickstart` and check that the workdir was not created."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import tiny_cfg

from experiments import quickstart
from stablerl_jax import losses, presets
from stablerl_jax.config import ConfigError, LossConfig, TaskConfig
from stablerl_jax.data import gsm8k
from stablerl_jax.data.task import load_split
from stablerl_jax.model import moe
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import loop, sft
from stablerl_jax.workdir import LOCK_FILE

# (case, overrides, the message must contain these)
OVERRIDES = [
    ("unknown field", ["rl.bogus=1"], ["unknown field 'bogus'", "rl has"]),
    ("unknown section", ["bogus.steps=1"], ["unknown field 'bogus'", "section"]),
    ("not key=value", ["rl.steps"], ["expected section.field=value"]),
    ("ill-typed int", ["rl.steps=abc"], ["rl.steps", "cannot parse 'abc'"]),
    ("ill-typed bool", ["loss.clip=maybe"], ["loss.clip", "true/false"]),
    ("section as a value", ["rl.optim=1"], ["is a section", "rl.optim.learning_rate"]),
    ("zero size", ["rl.prompts_per_step=0"], ["rl.prompts_per_step", "positive int"]),
    ("negative size", ["model.d_model=-4"], ["model.d_model", "positive int"]),
    ("mini-batches that do not divide", ["rl.num_minibatches=3"],
     ["rl.num_minibatches", "must divide"]),
    ("unknown loss", ["loss.name=ppo"], ["loss.name", "minirl"]),
    ("unknown replay", ["rl.replay=r4"], ["rl.replay", "'r2'"]),
    ("unknown numerics", ["sampling.numerics=fp4"], ["sampling.numerics", "fp8"]),
    ("train numerics for the sampler", ["sampling.numerics=train"],
     ["sampling.numerics", "inference preset"]),
    ("NaN learning rate", ["rl.optim.learning_rate=nan"], ["rl.optim.learning_rate"]),
    ("negative learning rate", ["rl.optim.learning_rate=-1e-4"],
     ["rl.optim.learning_rate", "> 0"]),
    ("infinite SFT learning rate", ["sft.optim.learning_rate=inf"],
     ["sft.optim.learning_rate", "finite"]),
    ("adam b1 = 1", ["rl.optim.b1=1"], ["rl.optim.b1", "[0, 1)"]),
    ("adam b2 = NaN", ["rl.optim.b2=nan"], ["rl.optim.b2"]),
    ("NaN weight decay", ["rl.optim.weight_decay=nan"], ["rl.optim.weight_decay", "finite"]),
    ("adam eps underflows", ["rl.optim.eps=1e-45"], ["rl.optim.eps", ">= 1e-30"]),
    ("clip range", ["loss.eps_low=1.5"], ["loss.eps_low", "[0, 1)"]),
    ("IS cap below 1", ["loss.tis_cap=0.5"], ["loss.tis_cap", ">= 1"]),
    ("infinite router noise", ["sampling.router_noise_std=inf"],
     ["sampling.router_noise_std", "finite"]),
    ("group of one", ["rl.group_size=1"], ["rl.group_size", ">= 2"]),
    ("negative seed", ["rl.seed=-1"], ["rl.seed", ">= 0"]),
    ("mesh not ints", ["mesh=a,b"], ["mesh", "comma-separated ints"]),
    ("mesh of two axes", ["mesh=2,2"], ["mesh", "three positive ints"]),
    ("mesh larger than the devices", ["mesh=1,1,16"], ["mesh=(1, 1, 16)", "devices"]),
    ("eval batch the mesh does not divide", ["mesh=8,1,1", "rl.eval_problems=3",
                                             "rl.eval_k=1"], ["mesh", "eval batch"]),
    ("sequence longer than the model", ["sampling.max_new_tokens=100"],
     ["model.max_seq_len", "max_new_tokens"]),
    ("gsm8k without its directory", ["task.kind=gsm8k"], ["task.jsonl_dir"]),
]


@pytest.mark.parametrize("case, overrides, needles", OVERRIDES, ids=[c[0] for c in OVERRIDES])
def test_bad_overrides_write_nothing(tmp_path, capsys, case, overrides, needles):
    workdir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        quickstart.main(["--workdir", str(workdir), "--quiet", "--compile-cache=", *overrides])
    assert e.value.code == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, (case, err)
    assert not workdir.exists()


def test_a_workdir_that_is_a_file(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(SystemExit):
        quickstart.main(["--workdir", str(path), "--quiet", "--compile-cache="])
    assert "is a file" in capsys.readouterr().err and path.read_text() == "x"


def test_a_read_only_workdir(tmp_path, monkeypatch, capsys):
    # Permission bits do not stop root (who runs these tests in CI), so the check itself
    # is exercised: os.access says the parent is not writable.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(SystemExit):
        quickstart.main(["--workdir", str(tmp_path / "run"), "--quiet", "--compile-cache="])
    assert "not writable" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# JSONL data: (case, file content, the message must contain)
JSONL = [
    ("missing field", b'{"question": "1+1?"}\n', "missing field 'answer'"),
    ("not an object", b'[1, 2]\n', "expected a JSON object"),
    ("bad JSON", b'{"question": \n', "malformed record"),
    ("no final answer line", b'{"question": "q", "answer": "two"}\n', "#### N"),
    ("an answer math-verify cannot read", b'{"question": "q", "answer": "x #### banana"}\n',
     "'banana' is not a number"),
    ("invalid UTF-8", b'{"question": "\xff\xfe", "answer": "#### 2"}\n', "utf-8"),
    ("a huge line", b'{"question": "' + b"9" * (gsm8k.MAX_LINE_BYTES + 10)
     + b'", "answer": "#### 2"}\n', "MAX_LINE_BYTES"),
    ("an empty file", b"", "no records"),
]


@pytest.mark.parametrize("case, content, needle", JSONL, ids=[c[0] for c in JSONL])
def test_bad_jsonl_names_file_and_line(tmp_path, case, content, needle):
    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        gsm8k.parse_jsonl(str(path))
    msg = str(e.value)
    assert needle in msg and str(path) in msg, msg
    if content:
        assert f"{path}:1" in msg  # the line
        # skip_malformed skips it (and the split, left empty, is then an error itself).
        with pytest.raises(ValueError, match="no records"):
            gsm8k.parse_jsonl(str(path), skip_malformed=True)


def test_a_missing_data_dir(tmp_path):
    task = TaskConfig(kind="gsm8k", jsonl_dir=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="task.jsonl_dir"):
        load_split(task, "train", str(tmp_path / "data"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A completed 1-step run (and its cold start) to resume from."""
    root = tmp_path_factory.mktemp("bad_resume")
    cfg = tiny_cfg(steps=1, eval_every=1)
    loop.run(cfg, str(root / "run"), progress=False)
    return cfg, root / "run"


def _snapshot(path):
    """Every file's name, size and mtime; but the lock file, which a refused run also
    takes and releases (stablerl_jax/workdir.py)."""
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*") if p.name != LOCK_FILE)


def test_resuming_with_another_model_config_is_refused(finished_run):
    cfg, workdir = finished_run
    before = _snapshot(workdir)
    other = cfg.replace(model=cfg.model.replace(d_model=48), rl=cfg.rl.replace(steps=2))
    with pytest.raises(ValueError) as e:
        loop.run(other, str(workdir), progress=False)
    msg = str(e.value)
    assert "model.d_model: 32 -> 48" in msg and "--allow-config-change model.d_model" in msg
    assert "rl.steps" not in msg  # how long a run lasts may change
    assert _snapshot(workdir) == before


def test_the_only_checkpoint_corrupted_is_refused(finished_run, tmp_path):
    cfg, workdir = finished_run
    copy = tmp_path / "run"
    import shutil
    shutil.copytree(workdir, copy)
    step_dir = copy / "checkpoints" / "1"
    data = max((p for p in step_dir.rglob("*") if p.is_file() and "state" in p.parts),
               key=lambda p: p.stat().st_size)
    data.write_bytes(bytes(data.stat().st_size))
    with pytest.raises(ValueError, match="no checkpoint restores"):
        loop.run(cfg, str(copy), progress=False)
    assert (copy / "checkpoints" / "1.corrupt").is_dir()  # kept for inspection


def test_a_cold_start_with_other_settings_is_refused(tmp_path):
    cfg = tiny_cfg()
    workdir = tmp_path / "run"
    (workdir / "sft").mkdir(parents=True)
    (workdir / "sft" / "commit_success.txt").write_text("")
    other = cfg.replace(model=cfg.model.replace(d_model=48))
    (workdir / "sft.json").write_text(json.dumps(sft.sft_settings(other)))
    with pytest.raises(ValueError, match=r"sft was trained with other settings \(model.d_model\)"):
        sft.cold_start(cfg, data=None, workdir=str(workdir), progress=False)


# Tensors handed to the library directly.
def test_replay_tensors_name_shape_dtype_and_values():
    logits = jnp.zeros((3, 4))
    for replay, needle in [(jnp.zeros((3, 3), jnp.int32), "replay: shape"),
                           (jnp.zeros((3, 2), jnp.float32), "replay: dtype"),
                           (jnp.array([[0, 4], [1, 2], [0, 1]]), "values must be in"),
                           (jnp.array([[1, 1], [1, 2], [0, 1]]), "repeat an expert"),
                           (jnp.array([[-1, 2], [1, 2], [0, 1]]), "mix both")]:
        with pytest.raises(ValueError, match=needle):
            moe.route(logits, 2, replay)


def test_model_inputs_name_the_field():
    cfg = dataclasses.replace(tiny_cfg().model)
    params = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), cfg))
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    tokens = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="replay: shape"):
        tf.forward(params, tokens, cfg, replay_BxTxLxK=jnp.zeros((2, 5, 1, 2), jnp.int32))
    with pytest.raises(ValueError, match="vocab_size=64"):
        tf.forward(params, tokens.at[0, 0].set(99), cfg)


def test_loss_inputs_of_mismatched_shapes():
    logp = jnp.zeros((2, 3))
    ok = losses.LossBatch(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3)),
                          advantages_B=jnp.zeros(2))
    for bad, needle in [(ok._replace(mask_BxT=jnp.ones((2, 4))), "batch.mask_BxT: shape"),
                        (ok._replace(old_logp_BxT=jnp.zeros(3)), "batch.old_logp_BxT"),
                        (ok._replace(advantages_B=jnp.zeros(3)), "batch.advantages_B"),
                        (ok._replace(advantages_B=None), "advantages_B")]:
        with pytest.raises(ValueError, match=needle):
            losses.minirl(logp, bad, LossConfig())
    assert np.isfinite(float(losses.minirl(logp, ok, LossConfig())[0]))


def test_config_errors_are_config_errors():
    # One class of error for every setting, so a caller can catch them all at once.
    with pytest.raises(ConfigError):
        presets.preset("tiny", ["rl.steps=0"])

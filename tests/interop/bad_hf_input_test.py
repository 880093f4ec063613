"""A hostile or damaged `--hf` checkpoint through the command line: weights that are
NaN, inf or of another dtype, a checkpoint directory that cannot be written, a
config.json at odds with itself or with its weights, a shard index that is not one,
and a chat template that would not finish. Each is exit status 2 and one line naming
the tensor, field or file and the fix, with nothing outside the workdir changed (the
checkpoint included). The checkpoint is tests/hf_fixtures.py's Qwen3-MoE-style one
(the `hf_dir` fixture)."""
import json
import os
import shutil

import numpy as np
import pytest
from cli_helpers import one_line, refused_outside_untouched
from safetensors.numpy import load_file, save_file


def _damaged(src, dest, change):
    """A copy of the checkpoint `src` with one tensor of layer 1 changed."""
    shutil.copytree(src, dest)
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    file = dest / index["weight_map"][name]
    tensors = load_file(str(file))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(file), metadata={"format": "pt"})
    return dest, name, file.name


@pytest.mark.parametrize("case", ["nan", "inf", "float16", "int32"])
def test_bad_hf_weights_are_refused_naming_tensor_and_file(tmp_path, capsys, hf_dir, case):
    def change(w):
        if case in ("nan", "inf"):
            w = w.copy()
            w[3, 2] = np.nan if case == "nan" else -np.inf
            return w
        return w.astype(case)
    path, name, file = _damaged(hf_dir, tmp_path / "ckpt", change)
    workdir = tmp_path / "run"
    needles = ([f"tensor {name} in {file} holds NaN or inf"] if case in ("nan", "inf") else
               [f"tensor {name} in {file} is {case}", "torch_dtype is float32"])
    one_line(capsys, ["--workdir", str(workdir), "--quiet", "--compile-cache=",
                      "--hf", str(path)], *needles)
    assert not (workdir / "checkpoints").exists() and not (workdir / "metrics.jsonl").exists()


@pytest.mark.integration
def test_a_read_only_checkpoint_directory_is_one_line(tmp_path, capsys, monkeypatch,
                                                      hf_dir):
    workdir = tmp_path / "run"
    access = os.access  # root ignores permission bits: make the check itself say no
    monkeypatch.setattr(os, "access", lambda p, mode: not str(p).endswith("checkpoints")
                        and access(p, mode))
    one_line(capsys, ["--workdir", str(workdir), "--quiet", "--compile-cache=",
                      "--hf", str(hf_dir)], "checkpoints' is not writable")
    assert not (workdir / "metrics.jsonl").exists()


# A --hf config.json at odds with itself or with its weights.
def _drop_head_dim(hf):
    hf.pop("head_dim")
    return {**hf, "num_attention_heads": 0}


HF_CONFIGS = [  # (case, change(config.json dict) or the file's text, the line must contain)
    ("more layers than the weights", lambda hf: {**hf, "num_hidden_layers": 3},
     ["num_hidden_layers is 3, but the weights hold 2", "set num_hidden_layers to 2"]),
    ("a million layers", lambda hf: {**hf, "num_hidden_layers": 10**6},
     ["num_hidden_layers is 1000000, but the weights hold 2", "set num_hidden_layers to 2"]),
    ("a fractional layer count", lambda hf: {**hf, "num_hidden_layers": 2.7},
     ["num_hidden_layers: must be an int >= 1", "got 2.7", "correct it in config.json"]),
    ("an integral float layer count", lambda hf: {**hf, "num_hidden_layers": 2.0},
     ["num_hidden_layers: must be an int >= 1", "got 2.0", "correct it in config.json"]),
    ("an infinite vocabulary", lambda hf: {**hf, "vocab_size": float("inf")},
     ["vocab_size: must be an int >= 1", "got inf", "correct it in config.json"]),
    ("a vocabulary as a list", lambda hf: {**hf, "vocab_size": [64]},
     ["vocab_size: must be an int >= 1", "got [64]", "correct it in config.json"]),
    ("zero heads without head_dim", _drop_head_dim,
     ["num_attention_heads: must be an int >= 1", "got 0", "correct it in config.json"]),
    ("vocab rows that disagree", lambda hf: {**hf, "vocab_size": 65},
     ["vocab_size is 65, but the weights hold 64", "model.embed_tokens.weight",
      "set vocab_size to 64"]),
    ("an expert count that disagrees", lambda hf: {**hf, "num_experts": 16},
     ["num_experts is 16, but the weights hold 8", "set num_experts to 8"]),
    ("a string for a bool", lambda hf: {**hf, "tie_word_embeddings": "false"},
     ["tie_word_embeddings: must be true or false", "correct it in config.json"]),
    ("not JSON", '{"vocab_size": 64,', ["config.json: not valid JSON",
                                        "restore the checkpoint's file"]),
    # Each float setting is checked in float32, the dtype the model computes it in: a
    # rope_theta that overflows it had trained on with a numpy warning and a rising loss.
    ("a rope_theta float32 cannot hold", lambda hf: {**hf, "rope_theta": 1e39},
     ["rope_theta: is 1e+39, which float32", "cannot hold", "correct it in config.json"]),
    ("an rms_norm_eps that is 0 in float32", lambda hf: {**hf, "rms_norm_eps": 1e-50},
     ["rms_norm_eps: is 1e-50, which float32", "correct it in config.json"]),
    ("a router_aux_loss_coef beyond float32", lambda hf: {**hf, "router_aux_loss_coef": 1e300},
     ["router_aux_loss_coef: is 1e+300", "correct it in config.json"]),
]


@pytest.mark.parametrize("case, change, needles", HF_CONFIGS, ids=[c[0] for c in HF_CONFIGS])
def test_a_bad_hf_config_json_is_one_line_naming_field_and_file(tmp_path, capsys, hf_dir,
                                                                case, change, needles):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_dir, ckpt)
    source = ckpt / "config.json"
    source.write_text(change if isinstance(change, str) else
                      json.dumps(change(json.loads(source.read_text()))))
    refused_outside_untouched(capsys, tmp_path, ["--hf", str(ckpt)], f"{source}: ",
                              *needles)


def _index_moving(name):
    """A change of the shard index that places tensor `name` in another shard."""
    def change(index):
        files = sorted(set(index["weight_map"].values()))
        other = next(f for f in files if f != index["weight_map"][name])
        return {**index, "weight_map": {**index["weight_map"], name: other}}
    return change


GATE = "model.layers.0.mlp.gate.weight"
# Found by tests/fuzz_files_test.py: an index that is not an object as AttributeError, one that
# places a tensor in a shard that does not hold it as safetensors' SafetensorError (a
# traceback at the command line); fixed in interop/hf_checkpoint.py.
HF_INDEXES = [  # (case, change(index dict) or the file's text, the named file, needles)
    ("null", "null", "model.safetensors.index.json",
     ["must be a JSON object whose weight_map maps each tensor name to a file name",
      "restore the checkpoint's index"]),
    ("a list", "[]", "model.safetensors.index.json", ["must be a JSON object"]),
    ("a string", '"weights"', "model.safetensors.index.json", ["must be a JSON object"]),
    ("a tensor placed in the wrong shard", _index_moving(GATE), None,
     [f"holds no tensor {GATE}, which", "model.safetensors.index.json places there",
      "restore the checkpoint's index"]),
]


@pytest.mark.parametrize("case, change, named, needles", HF_INDEXES,
                         ids=[c[0] for c in HF_INDEXES])
def test_a_bad_hf_shard_index_is_one_line_naming_the_file(tmp_path, capsys, hf_dir, case,
                                                         change, named, needles):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_dir, ckpt)
    source = ckpt / "model.safetensors.index.json"
    index = json.loads(source.read_text())
    source.write_text(change if isinstance(change, str) else json.dumps(change(index)))
    if named is None:  # the shard the index wrongly names
        named = [f for f in sorted(set(index["weight_map"].values()))
                 if f != index["weight_map"][GATE]][0]
    refused_outside_untouched(capsys, tmp_path, ["--hf", str(ckpt)], f"{ckpt / named}: ",
                              *needles)


# A checkpoint's chat template is code: a hostile one, found by a `--hf` run with
# task.chat_template=true as the checkpoint's tokenizer_config.json "chat_template" or its
# chat_template.jinja, is refused when the data loads (before any training) with one line
# naming that file and the bound (data/template_sandbox.py, RenderLimits).
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"
HOSTILE_TEMPLATES = [  # (file, template, the line must contain)
    pytest.param("tokenizer_config.json", NESTED.replace("BODY", "x"),
                 ["builds the rendered text of ~4,194,30", "> 4,194,304 (RenderLimits.chars)"],
                 id="nested range(100000) loops"),
    pytest.param("chat_template.jinja", "{{ ('x'*6*10**9)|length }}",
                 ["builds a string of ~6,000,000,000 characters > 4,194,304 "
                  "(RenderLimits.chars)"], id="a string of 6e9 characters"),
    pytest.param("tokenizer_config.json", NESTED.replace("BODY", ""),
                 ["ran past the time limit of 1 s per render (RenderLimits.seconds)"],
                 id="nested loops that render nothing"),
    pytest.param("chat_template.jinja", NESTED.replace("BODY", ""),
                 ["ran past the time limit of 10 s per render (RenderLimits.seconds)"],
                 id="nested loops that render nothing, 10 s", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("file, template, needles", HOSTILE_TEMPLATES)
def test_a_hostile_chat_template_is_one_line_naming_its_file(tmp_path, capsys, monkeypatch,
                                                            hf_dir, file, template, needles):
    from hf_fixtures import CHATML_TEMPLATE, write_qwen_tokenizer

    from stablerl_jax.data import chat_template
    from stablerl_jax.data.template_sandbox import RenderLimits
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_dir, ckpt)
    write_qwen_tokenizer(ckpt, chat_template=template if file == "tokenizer_config.json"
                         else CHATML_TEMPLATE)
    if file == "chat_template.jinja":
        (ckpt / file).write_text(template)  # wins over tokenizer_config.json's
    if "1 s per render" in needles[0]:  # the time bound, shortened from 10 s for the suite
        monkeypatch.setattr(chat_template, "task_template", lambda task: (
            chat_template.ChatTemplate.from_dir(task.tokenizer_dir, RenderLimits(seconds=1))))
    refused_outside_untouched(capsys, tmp_path, ["--hf", str(ckpt), "sft.steps=0",
                                                 "task.chat_template=true"],
                              f"{ckpt / file}: the chat template ", *needles,
                              "fix the template or set task.chat_template=false")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

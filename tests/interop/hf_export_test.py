"""`save_qwen3_moe(..., tokenizer_dir=, stop_ids=)` writes a directory that transformers
and this project both start from (marker `interop`: transformers and torch read it back).

The tokenizer directory is the Qwen-style fixture (tests/hf_fixtures.py) in both places a
chat template lives: inside tokenizer_config.json (transformers 4's layout, the fixture's
own) and in chat_template.jinja (what transformers 5's `save_pretrained` writes). From
either, the export renders the same chat template as its source in transformers and in
`ChatTemplate`, lists both stop ids in generation_config.json (keeping the source's
sampling settings), gives `HFTokenizer` the source's special and stop ids, and loads as a
Qwen3MoeForCausalLM whose logits are the exported policy's.
"""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import write_qwen_tokenizer
from tolerance import LAMBDA, assert_close, forward_chain

torch = pytest.importorskip("torch", reason="the interop extra (torch) is not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the interop extra (transformers) is not installed")

from stablerl_jax.config import ModelConfig  # noqa: E402
from stablerl_jax.data.chat_template import ChatTemplate  # noqa: E402
from stablerl_jax.data.hf_tokenizer import HFTokenizer  # noqa: E402
from stablerl_jax.interop import hf_export  # noqa: E402
from stablerl_jax.model import transformer as tf  # noqa: E402

pytestmark = pytest.mark.interop
# The fixture's tokenizer has at most 405 tokens; the embedding has more rows, as
# Qwen3-30B-A3B's has.
CFG = ModelConfig(vocab_size=512, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_experts=4, top_k=2, expert_ffn_dim=16, max_seq_len=64)
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 12 + 7?"}]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{layout: tokenizer directory}: the fixture as written ("config": the template in
    tokenizer_config.json) and as transformers saves it ("jinja"), with a
    generation_config.json that also holds sampling settings."""
    root = tmp_path_factory.mktemp("sources")
    config, jinja = root / "config", root / "jinja"
    config.mkdir()
    write_qwen_tokenizer(config)
    gen = json.loads((config / "generation_config.json").read_text())
    (config / "generation_config.json").write_text(json.dumps(
        {**gen, "temperature": 0.6, "top_p": 0.95, "do_sample": True}))
    transformers.PreTrainedTokenizerFast.from_pretrained(str(config)).save_pretrained(
        str(jinja))
    # A checkpoint ships generation_config.json beside the model, not the tokenizer.
    shutil.copyfile(config / "generation_config.json", jinja / "generation_config.json")
    return {"config": config, "jinja": jinja}


def test_transformers_saves_the_template_as_chat_template_jinja(sources):
    assert (sources["jinja"] / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads(
        (sources["jinja"] / "tokenizer_config.json").read_text())
    assert "chat_template" in json.loads(
        (sources["config"] / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("layout", ["config", "jinja"])
def test_the_export_serves_the_sources_template_stop_ids_and_model(sources, tmp_path,
                                                                   layout):
    src, out = sources[layout], str(tmp_path / "export")
    source_tok = HFTokenizer.from_dir(str(src))
    im_end, endoftext = (source_tok.tok.token_to_id(t) for t in ("<|im_end|>",
                                                                  "<|endoftext|>"))
    assert source_tok.stop_ids == (im_end, endoftext)
    params = tf.init_params(jax.random.key(0), CFG)
    hf_export.save_qwen3_moe(params, CFG, out,
                             config_extra={"eos_token_id": im_end, "pad_token_id": endoftext,
                                           "bos_token_id": None},
                             tokenizer_dir=str(src), stop_ids=(im_end, endoftext))

    render = lambda tok: tok.apply_chat_template(MESSAGES, tokenize=False,
                                                 add_generation_prompt=True)
    want = render(transformers.AutoTokenizer.from_pretrained(str(src)))
    assert want.startswith("<|im_start|>system\n") and want.endswith("<|im_start|>assistant\n")
    assert render(transformers.AutoTokenizer.from_pretrained(out)) == want
    assert ChatTemplate.from_dir(out).render(MESSAGES) == want

    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == [im_end, endoftext]
    assert generation.pad_token_id == endoftext
    assert (generation.temperature, generation.top_p) == (0.6, 0.95)  # the source's, kept
    exported = HFTokenizer.from_dir(out)
    assert (exported.eos_id, exported.pad_id, exported.bos_id, exported.stop_ids) == (
        source_tok.eos_id, source_tok.pad_id, source_tok.bos_id, source_tok.stop_ids)

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.vocab_size == CFG.vocab_size
    # The exported weights are the policy's: transformers' logits on the rendered prompt
    # match this project's forward within the float32 bound (as tests/interop/hf_parity_test.py).
    ids = np.asarray([exported.encode(want)])
    with torch.no_grad():
        ref = model.eval()(input_ids=torch.tensor(ids)).logits.numpy()[0]
    hidden, _ = tf.forward(params, jnp.asarray(ids), CFG)
    logits = np.asarray(tf.logits(params, hidden, CFG))[0]
    assert_close(logits, ref, n=forward_chain(CFG, ids.shape[1]) + CFG.d_model, lam=LAMBDA,
                 scale="max")


def test_without_a_tokenizer_dir_generation_config_still_lists_the_stop_ids(tmp_path):
    # The SentencePiece tokenizer (the tiny preset) has no files to copy: one stop id.
    hf_export.save_qwen3_moe(tf.init_params(jax.random.key(1), CFG), CFG, str(tmp_path),
                             config_extra={"eos_token_id": 3, "pad_token_id": 0,
                                           "bos_token_id": 2},
                             stop_ids=(3,))
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "eos_token_id": 3, "pad_token_id": 0, "bos_token_id": 2}
    assert not (tmp_path / "tokenizer.json").exists()
    assert transformers.GenerationConfig.from_pretrained(str(tmp_path)).eos_token_id == 3


def test_generation_config_replaces_only_the_ids():
    source = {"eos_token_id": 7, "bos_token_id": 5, "pad_token_id": 7, "top_k": 20}
    got = hf_export.generation_config(source, (1, 2), {"pad_token_id": 2, "bos_token_id": None})
    assert got == {"eos_token_id": [1, 2], "bos_token_id": 5, "pad_token_id": 2, "top_k": 20}
    assert hf_export.generation_config({}, (), {}) == {}

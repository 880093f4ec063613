"""The Hugging Face tokenizer.json tokenizer behind the `Tokenizer` protocol: special ids
from the directory's config files (Qwen3's layout: no BOS), round trip, decoding that
never raises, the raw decode that keeps special tokens, stop ids, and clear errors. The tokenizer is the tiny byte-level BPE of
tests/hf_fixtures.py."""
import json

import numpy as np
import pytest
from hf_fixtures import write_qwen_tokenizer

from stablerl_jax.data import batching
from stablerl_jax.data.hf_tokenizer import HFTokenizer
from stablerl_jax.data.tokenizer import SentencePieceTokenizer

TEXTS = ["What is 12 + 7?", "The answer is 19.", "Let's think step by step: 3 * 4 = 12.",
         "#### 42"]


def _write(path, tokenizer_config=None):
    """The Qwen3-style fixture's tokenizer.json with only `tokenizer_config` beside it."""
    raw = write_qwen_tokenizer(path)
    (path / "generation_config.json").unlink()
    (path / "tokenizer_config.json").unlink()
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return raw


def test_special_ids_come_from_the_directory_like_qwen3(tmp_path):
    # Qwen3's tokenizer_config: eos <|im_end|>, pad <|endoftext|>, no BOS.
    raw = _write(tmp_path, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                            "bos_token": None})
    tok = HFTokenizer.from_dir(str(tmp_path))
    assert tok.eos_id == raw.token_to_id("<|im_end|>")
    assert tok.pad_id == raw.token_to_id("<|endoftext|>")
    assert tok.bos_id is None
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    for text in TEXTS + ["unseen words 0123"]:  # byte-level: any text round trips
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert not {tok.eos_id, tok.pad_id} & set(ids)
    # Specials and ids past the tokenizer (a larger model vocab) are dropped, never raise.
    ids = [tok.pad_id] + tok.encode("12 + 7") + [tok.eos_id, tok.vocab_size + 5]
    assert tok.decode(ids) == "12 + 7"


def test_the_raw_decode_keeps_every_special_token(tmp_path):
    raw = write_qwen_tokenizer(tmp_path)
    tok = HFTokenizer.from_dir(str(tmp_path))
    text = "<|im_start|>assistant\n<think>\nadd</think>\n#### 19<|im_end|><|endoftext|>"
    ids = tok.encode(text)
    assert tok.decode_raw(ids) == text
    assert tok.decode(ids) == "assistant\n<think>\nadd</think>\n#### 19"
    # pad = <|endoftext|> is kept (the caller passes no padding); ids past the tokenizer
    # are dropped.
    assert tok.pad_id == raw.token_to_id("<|endoftext|>")
    assert tok.decode_raw(ids + [tok.vocab_size + 5]) == text
    assert [tok.decode_raw([i]) for i in tok.stop_ids] == ["<|im_end|>", "<|endoftext|>"]


def test_no_bos_means_prompts_start_with_their_text(tmp_path):
    _write(tmp_path, {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|endoftext|>"})
    tok = HFTokenizer.from_dir(str(tmp_path))
    tokens, mask, _ = batching.prompt_batch([{"prompt": "What is 12 + 7?", "answer": "19"}],
                                            tok, 1, 16)
    ids = tok.encode("What is 12 + 7?")
    np.testing.assert_array_equal(tokens[0, mask[0]], ids)
    assert (tokens[0, ~mask[0]] == tok.pad_id).all()


def test_fallbacks_overrides_and_errors(tmp_path):
    raw = _write(tmp_path)  # no tokenizer_config.json
    with pytest.raises(ValueError, match="eos_token"):
        HFTokenizer.from_dir(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [raw.token_to_id("<|im_end|>"), 0]}))
    tok = HFTokenizer.from_dir(str(tmp_path))
    assert tok.eos_id == raw.token_to_id("<|im_end|>") == tok.pad_id  # pad falls back to eos
    tok = HFTokenizer.from_dir(str(tmp_path), pad_token="<|endoftext|>")
    assert tok.pad_id == raw.token_to_id("<|endoftext|>")
    with pytest.raises(ValueError, match="pad_token='<nope>' is not a token"):
        HFTokenizer.from_dir(str(tmp_path), pad_token="<nope>")
    with pytest.raises(FileNotFoundError, match="tokenizer_dir"):
        HFTokenizer.from_dir(str(tmp_path / "missing"))


def test_stop_ids_are_eos_and_generation_configs_list(tmp_path):
    raw = write_qwen_tokenizer(tmp_path)
    im_end, endoftext = raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>")
    assert HFTokenizer.from_dir(str(tmp_path)).stop_ids == (im_end, endoftext)
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": [endoftext, im_end, endoftext]}))
    assert HFTokenizer.from_dir(str(tmp_path)).stop_ids == (im_end, endoftext)  # eos first
    gen.write_text(json.dumps({"eos_token_id": im_end}))  # an int, not a list
    assert HFTokenizer.from_dir(str(tmp_path)).stop_ids == (im_end,)
    gen.unlink()  # no generation_config.json: the tokenizer's eos alone
    assert HFTokenizer.from_dir(str(tmp_path)).stop_ids == (im_end,)
    gen.write_text(json.dumps({"eos_token_id": [im_end, 10**6]}))
    with pytest.raises(ValueError, match="a stop id=1000000 must be a token id"):
        HFTokenizer.from_dir(str(tmp_path))
    gen.write_text(json.dumps({"eos_token_id": ["<|im_end|>"]}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        HFTokenizer.from_dir(str(tmp_path))
    assert SentencePieceTokenizer.stop_ids == (SentencePieceTokenizer.eos_id,)

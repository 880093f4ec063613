"""A Hugging Face `tokenizer.json` tokenizer (the `tokenizers` package) behind the
`Tokenizer` protocol: the one a checkpoint was trained with (Qwen3's byte-level BPE), for
RL from that checkpoint. Special ids come from its directory, never from this project's
SentencePiece convention (pad 0, bos 2, eos 3):

    eos_id   tokenizer_config.json "eos_token", else generation_config.json
             "eos_token_id" (its first entry when a list), else config.json's
    pad_id   tokenizer_config.json "pad_token", else the eos token (pad slots are masked
             everywhere, so any real id serves)
    bos_id   tokenizer_config.json "bos_token", or None (Qwen3: prompts start with text)
    stop_ids eos_id, then each id of generation_config.json's "eos_token_id" (int or list;
             Qwen3 lists `<|im_end|>` and `<|endoftext|>`), in order, without duplicates:
             a response ends at the first of any

`eos_token=` / `pad_token=` / `bos_token=` (token strings) override each. `encode` adds
no special tokens (batching adds BOS) and splits added tokens out of the text, so a
rendered template's `<|im_start|>` is one id. `decode` drops pad/bos/eos, special tokens
(Qwen3's `<think>` / `</think>` are added, not special, so the reward still finds them)
and ids past the tokenizer's (Qwen3-30B-A3B's embedding has 151,936 rows for 151,669
tokens), so decoding model output never raises; `decode_raw` drops only those ids.

`read_tokenizer` checks tokenizer.json first, as the `tokenizers` library aborts the
process, past recovery, on a file too large for memory: size (MAX_TOKENIZER_BYTES), then,
via Python's json, shape (an object whose "model" has a type the library has, "merges" a
list) and counts (MAX_VOCAB, MAX_MERGES, MAX_ADDED_TOKENS). A file failing these, or refused
by the library (a merge of a token not in the vocab), is a one-line ValueError naming it.
"""
from __future__ import annotations

import json
import os
from typing import Iterable

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _models

# Limits on a tokenizer.json, with a margin over the public ones: Qwen3's file is 11.4 MB
# (151,669 tokens, 151,387 merges, 26 added tokens), Llama 3's 9.1 MB (128,256 tokens,
# 280,147 merges, 256 added tokens), Gemma 3's 33.4 MB (262,144 tokens), the largest here.
# Each limit is at least 4x the Qwen3 and Llama 3 values and holds Gemma 3's. The size
# bounds what Python's json builds to count (at most ~24 bytes per byte of file, ~1.5 GB
# at the limit, for a file of empty arrays; ~7x for a Qwen3-sized file); the counts bound
# what the library builds.
MAX_TOKENIZER_BYTES = 64 << 20   # 5.9x Qwen3's, 2x Gemma 3's
MAX_VOCAB = 1 << 20              # 1,048,576: 6.9x Qwen3's, 4x Gemma 3's
MAX_MERGES = 1 << 21             # 2,097,152: 13.9x Qwen3's, 7.5x Llama 3's
MAX_ADDED_TOKENS = 1 << 16       # 65,536: 256x Llama 3's
# The model types the library reads ("type" in tokenizer.json: BPE, Unigram, WordLevel,
# WordPiece), from its model classes.
MODEL_TYPES = tuple(sorted(m.__name__ for m in _models.Model.__subclasses__()))


def read_json(path: str) -> dict:
    """A tokenizer directory's JSON file, {} when absent; a clear error when corrupt."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({e}); restore the checkpoint's file"
                         ) from None


def _brief(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def read_tokenizer(file: str) -> _HFTokenizer:
    """`file` (a tokenizer.json) checked (module docstring), then parsed; ValueError if bad."""
    fix = "restore the checkpoint's tokenizer.json"
    size = os.path.getsize(file)
    if size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"{file}: {size:,} bytes > MAX_TOKENIZER_BYTES "
                         f"({MAX_TOKENIZER_BYTES:,}), far larger than any real tokenizer; "
                         f"{fix}")
    with open(file, "rb") as f:
        raw = f.read(MAX_TOKENIZER_BYTES + 1)  # the file may have grown since
    if len(raw) > MAX_TOKENIZER_BYTES:
        raise ValueError(f"{file}: more than MAX_TOKENIZER_BYTES ({MAX_TOKENIZER_BYTES:,}) "
                         f"bytes; {fix}")
    try:
        text = raw.decode("utf-8")  # as the library reads it
        del raw
        obj = json.loads(text)
    except RecursionError:
        raise ValueError(f"{file}: JSON nested deeper than Python's recursion limit; {fix}"
                         ) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{file}: not valid JSON ({_brief(e)}); {fix}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{file}: a JSON {type(obj).__name__}, not the object of a "
                         f"tokenizer; {fix}")
    model = obj.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{file}: no \"model\" object (the vocabulary and merges); {fix}")
    kind = model.get("type")
    if kind is not None and kind not in MODEL_TYPES:  # without one the library infers it
        raise ValueError(f"{file}: model type {kind!r} is not one the tokenizers library "
                         f"reads ({', '.join(MODEL_TYPES)}); {fix}")
    merges = model.get("merges")
    if merges is not None and not isinstance(merges, list):
        raise ValueError(f"{file}: model.merges is a JSON {type(merges).__name__}, not a "
                         f"list of merges; {fix}")
    _check_affixes(file, model, merges or (), fix)
    vocab = model.get("vocab")
    added = obj.get("added_tokens")
    for what, n, limit, name in (
            ("vocab entries", len(vocab) if isinstance(vocab, (dict, list)) else 0,
             MAX_VOCAB, "MAX_VOCAB"),
            ("merges", len(merges or ()), MAX_MERGES, "MAX_MERGES"),
            ("added tokens", len(added) if isinstance(added, list) else 0,
             MAX_ADDED_TOKENS, "MAX_ADDED_TOKENS")):
        if n > limit:
            raise ValueError(f"{file}: {n:,} {what} > {name} ({limit:,}), far more than "
                             f"any real tokenizer; {fix}")
    del obj, model, vocab, merges, added
    try:
        tok = _HFTokenizer.from_str(text)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 (Exception, or pyo3's PanicException)
        raise ValueError(f"{file}: the tokenizers library cannot read it ({_brief(e)}); "
                         f"{fix}") from None
    try:  # one that loads may still fail on text (a WordLevel model without its unk)
        tok.decode(tok.encode(PROBE_TEXT).ids)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001
        raise ValueError(f"{file}: the tokenizer loads but cannot encode text "
                         f"({_brief(e)}); {fix}") from None
    return tok


# What read_tokenizer encodes once: digits, operators and words, as the tasks' text holds.
PROBE_TEXT = "Compute 12 + 3 * (4 - 5) / 6 = ? The answer is 15."


def _merge_parts(merge) -> tuple | None:
    """A merge's (left, right): "a b" or ["a", "b"]; None otherwise (the library refuses it)."""
    if isinstance(merge, str):
        parts = merge.split(" ")
        return tuple(parts) if len(parts) == 2 else None
    if isinstance(merge, list) and len(merge) == 2 and all(isinstance(m, str) for m in merge):
        return tuple(merge)
    return None


def _check_affixes(file: str, model: dict, merges, fix: str) -> None:
    """A BPE's continuing_subword_prefix / end_of_word_suffix: null or str; each merge's right
    token starts with the prefix (the library cuts it off and panics on a shorter token)."""
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        affix = model.get(key)
        if affix is not None and not isinstance(affix, str):
            raise ValueError(f"{file}: model.{key} is a JSON {type(affix).__name__}, not a "
                             f"string or null; {fix}")
    prefix = model.get("continuing_subword_prefix")
    if not prefix:
        return
    for i, merge in enumerate(merges):
        parts = _merge_parts(merge)
        if parts is not None and not parts[1].startswith(prefix):
            raise ValueError(f"{file}: merge {i} ({merge!r}) does not start its right token "
                             f"with model.continuing_subword_prefix {prefix!r}; {fix}")


def token_text(v) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": …}."""
    if isinstance(v, dict):
        return v.get("content")
    return v


def _id_list(v, file: str) -> tuple[int, ...]:
    """An "eos_token_id" entry (absent, an int or a list of ints) as a tuple of ids."""
    ids = () if v is None else tuple(v) if isinstance(v, list) else (v,)
    if not all(type(i) is int for i in ids):
        raise ValueError(f"{file}: eos_token_id={v!r} must be a token id or a list of "
                         "token ids; fix the file")
    return ids


class HFTokenizer:
    """`tokenizer.json` + the special tokens of its directory (see the module docstring)."""

    def __init__(self, tokenizer: _HFTokenizer, *, eos_id: int, pad_id: int,
                 bos_id: int | None, stop_ids: tuple[int, ...] = ()):
        self.tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        stop_ids = tuple(dict.fromkeys((eos_id, *stop_ids)))  # eos first, no duplicates
        for name, v in (("eos_id", eos_id), ("pad_id", pad_id), ("bos_id", bos_id),
                        *(("a stop id", i) for i in stop_ids)):
            if v is not None and not (type(v) is int and 0 <= v < self.vocab_size):
                raise ValueError(f"{name}={v!r} must be a token id in [0, "
                                 f"{self.vocab_size}) of this tokenizer")
        self.eos_id, self.pad_id, self.bos_id = eos_id, pad_id, bos_id
        self.stop_ids = stop_ids
        specials = {t.content for t in tokenizer.get_added_tokens_decoder().values()
                    if t.special}
        self._skip = {i for i in (eos_id, pad_id, bos_id) if i is not None}
        self._skip |= {tokenizer.token_to_id(t) for t in specials}

    @classmethod
    def from_dir(cls, path: str, *, eos_token: str | None = None,
                 pad_token: str | None = None, bos_token: str | None = None) -> "HFTokenizer":
        """`path`/tokenizer.json with the directory's special ids (module docstring)."""
        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"{file}: not found; point task.tokenizer_dir at a "
                                    "directory holding the model's tokenizer.json")
        tok = read_tokenizer(file)
        tcfg = read_json(os.path.join(path, "tokenizer_config.json"))

        def id_of(text, field):
            i = tok.token_to_id(text)
            if i is None:
                raise ValueError(f"{field}={text!r} is not a token of {file}; pass "
                                 f"{field}= with one of its special tokens")
            return i

        gen_file = os.path.join(path, "generation_config.json")
        gen_stops = _id_list(read_json(gen_file).get("eos_token_id"), gen_file)
        eos = eos_token or token_text(tcfg.get("eos_token"))
        if eos is not None:
            eos_id = id_of(eos, "eos_token")
        else:
            model_file = os.path.join(path, "config.json")
            eos_ids = gen_stops or _id_list(read_json(model_file).get("eos_token_id"),
                                            model_file)
            if not eos_ids:
                raise ValueError(f"{path}: no eos_token in tokenizer_config.json and no "
                                 "eos_token_id in generation_config.json / config.json; "
                                 "pass eos_token=")
            eos_id = eos_ids[0]
        pad = pad_token or token_text(tcfg.get("pad_token"))
        pad_id = id_of(pad, "pad_token") if pad is not None else eos_id
        bos = bos_token or token_text(tcfg.get("bos_token"))
        bos_id = id_of(bos, "bos_token") if bos is not None else None
        return cls(tok, eos_id=eos_id, pad_id=pad_id, bos_id=bos_id, stop_ids=gen_stops)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids, skipping special tokens and ids past the tokenizer's."""
        keep = [int(i) for i in ids if 0 <= int(i) < self.vocab_size
                and int(i) not in self._skip]
        return self.tok.decode(keep, skip_special_tokens=False)

    def decode_raw(self, ids: Iterable[int]) -> str:
        """Text of the ids, special tokens as text; ids past the tokenizer's dropped."""
        keep = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.tok.decode(keep, skip_special_tokens=False)

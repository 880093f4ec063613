"""A Hugging Face `tokenizer.json` tokenizer (the `tokenizers` package) behind the
`Tokenizer` protocol: the tokenizer a real checkpoint was trained with (Qwen3's
byte-level BPE), for starting RL from that checkpoint.

Special ids come from the tokenizer directory, never from this project's SentencePiece
convention (pad 0, bos 2, eos 3):

    eos_id  tokenizer_config.json "eos_token", else generation_config.json
            "eos_token_id" (its first entry when a list), else config.json's
    pad_id  tokenizer_config.json "pad_token", else the eos token (a common convention;
            pad slots are masked everywhere, so any real id serves)
    bos_id  tokenizer_config.json "bos_token", or None: Qwen3 has no BOS, and prompts
            then start with their first text token

    stop_ids eos_id, then every id of generation_config.json's "eos_token_id" (an int or
            a list; Qwen3 lists <|im_end|> and <|endoftext|>) when that file exists,
            in order, without duplicates: a response ends at the first of any of them

An explicit `eos_token=` / `pad_token=` / `bos_token=` (token strings) overrides each.
`encode` adds no special tokens (the batching adds BOS where the tokenizer has one), and
splits the tokenizer's added tokens out of the text, so a rendered chat template's
`<|im_start|>` is one id. `decode` drops pad/bos/eos, every special token (Qwen3's
`<think>` / `</think>` are added but not special, so they stay and the reward can find
the think block), and ids the tokenizer does not have
(a model's embedding may have more rows than the tokenizer has tokens: Qwen3-30B-A3B has
151,936 rows for 151,669 tokens), so decoding model output never raises. `decode_raw`
drops only those ids: every special token stays as its text (`<|im_end|>`).
"""
from __future__ import annotations

import json
import os
from typing import Iterable

from tokenizers import Tokenizer as _HFTokenizer


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
        """Load `path`/tokenizer.json and take the special ids from the directory's
        tokenizer_config.json / generation_config.json / config.json."""
        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"{file}: not found; point task.tokenizer_dir at a "
                                    "directory holding the model's tokenizer.json")
        tok = _HFTokenizer.from_file(file)
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
        """Text of the ids with every special token as its text; ids past the
        tokenizer's are dropped."""
        keep = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.tok.decode(keep, skip_special_tokens=False)

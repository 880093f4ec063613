"""Tokenizers: a small protocol, and SentencePiece trained in-process on the task corpus
(the default; a checkpoint's own tokenizer.json is data/hf_tokenizer.py).

Special ids are fixed: pad = 0, unk = 1, bos = 2, eos = 3. Digits are single pieces, so
arithmetic is learnable token by token. Whitespace is verbatim (no dummy prefix, no
collapsing), so decode(encode(s)) == s for text whose characters the corpus contained.
`vocab_size` is at most the requested size (a small corpus supports fewer pieces).
"""
from __future__ import annotations

import io
import itertools
import os
from typing import Iterable, Protocol

import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer(Protocol):
    """What the trainer needs: this SentencePiece model or a `tokenizer.json`
    (data/hf_tokenizer.py). bos_id None: no BOS. stop_ids: the ids ending a response
    (eos_id first, unique; SFT solutions end with eos_id). `decode`: the reward's text
    (special tokens dropped); `decode_raw`: with them (`</s>`, `<|im_end|>`), for logs."""

    pad_id: int
    bos_id: int | None
    eos_id: int
    stop_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def decode_raw(self, ids: Iterable[int]) -> str: ...


class SentencePieceTokenizer:
    """A SentencePiece model with this project's fixed special ids."""

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
    stop_ids = (EOS_ID,)

    def __init__(self, model_proto: bytes):
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.model_proto = model_proto
        self.vocab_size = self.sp.get_piece_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "SentencePieceTokenizer":
        """Train in memory; `vocab_size` is an upper bound (hard_vocab_limit off)."""
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_writer=buf, vocab_size=vocab_size,
            model_type="bpe", split_digits=True, character_coverage=1.0,
            hard_vocab_limit=False, pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID,
            eos_id=EOS_ID, add_dummy_prefix=False, remove_extra_whitespaces=False,
            minloglevel=2)
        return cls(buf.getvalue())

    @classmethod
    def load_or_train(cls, path: str, texts: Iterable[str], vocab_size: int):
        """Reuse the model saved at `path`; train and save it there if absent."""
        if os.path.exists(path):
            with open(path, "rb") as f:
                tok = cls(f.read())
            if tok.vocab_size > vocab_size:
                raise ValueError(f"tokenizer at {path} has {tok.vocab_size} pieces > "
                                 f"vocab_size={vocab_size}; delete it or raise vocab_size")
            # A model trained on another corpus would silently map unseen characters to
            # unk; a sample of this corpus must encode without any.
            for text in itertools.islice(texts, 256):
                if UNK_ID in tok.encode(text):
                    raise ValueError(f"tokenizer at {path} does not cover the corpus (unk in "
                                     f"{text!r}); delete it to retrain, or use another path")
            return tok
        tok = cls.train(texts, vocab_size)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(tok.model_proto)
        os.replace(tmp, path)  # never leave a half-written model behind
        return tok

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids without pad/bos/eos; ids past the pieces decode as unk (never raises)."""
        ids = [int(i) if 0 <= int(i) < self.vocab_size else UNK_ID for i in ids
               if int(i) not in (PAD_ID, BOS_ID, EOS_ID)]
        return self.sp.decode(ids)

    def decode_raw(self, ids: Iterable[int]) -> str:
        """Text of the ids, control ids shown as their pieces (`<pad>`, `<s>`, `</s>`), which
        `sp.decode` would drop; ids past the pieces decode as unk, as in `decode`."""
        parts, run = [], []
        for i in ids:
            i = int(i) if 0 <= int(i) < self.vocab_size else UNK_ID
            if self.sp.is_control(i):
                parts += [self.sp.decode(run), self.sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(parts) + self.sp.decode(run)

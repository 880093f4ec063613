"""Prompt batches for RL (left-padded, G copies per prompt) and SFT batches.

Letters: B rows, P prompt slots, S sequence slots, T = S − 1 scored positions, G group size.

Row: [pad … pad, BOS, prompt tokens | …] (no BOS if the tokenizer has none: Qwen3). Left
padding to P slots ends every prompt at slot P − 1, so generation starts at slot P for the
whole batch; SFT rows (data/sft_data.py) put the response right after, right-padded.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

import numpy as np

from stablerl_jax.data.tokenizer import Tokenizer


class SFTBatch(NamedTuple):
    """A supervised batch (data/sft_data.py), mask in `logprobs.policy_logprobs`'s T-frame."""

    tokens_BxS: np.ndarray   # int32, left-padded prompt then response, right-padded
    attn_BxS: np.ndarray     # bool, real tokens
    mask_BxT: np.ndarray     # float32, 1 where tokens[:, t + 1] is a trained token


class PromptBatch(NamedTuple):
    """A left-padded prompt batch; unpacks as (tokens, mask, answers)."""

    prompt_tokens_BxP: np.ndarray  # int32, pad_id where the mask is False
    prompt_mask_BxP: np.ndarray  # bool, True on BOS and prompt tokens
    answers: list  # reference answer of each row (G equal entries per group)


def _encode(tok: Tokenizer, text: str, limit: int, field: str, rec) -> list[int]:
    ids = tok.encode(text)
    if len(ids) > limit:
        raise ValueError(f"record {rec.get('id')}: {field} has {len(ids)} tokens > {limit}; "
                         f"raise task.max_{field}_len or filter the data")
    return ids


def _bos(tok: Tokenizer) -> list[int]:
    return [] if tok.bos_id is None else [tok.bos_id]


def prompt_len(tok: Tokenizer, text: str) -> int:
    """Slots a prompt takes in a batch row: BOS (if the tokenizer has one) + its tokens."""
    return len(_bos(tok)) + len(tok.encode(text))


def split_by_length(records: Sequence[dict], tok: Tokenizer, max_prompt_len: int
                    ) -> tuple[list[dict], int]:
    """(records whose prompt fits max_prompt_len slots, count of the rest): applied when
    data loads, so no batch meets an over-long prompt."""
    kept = [r for r in records if prompt_len(tok, r["prompt"]) <= max_prompt_len]
    return kept, len(records) - len(kept)


def prompt_batch(records: Sequence[dict], tok: Tokenizer, group_size: int,
                 max_prompt_len: int) -> PromptBatch:
    """Left-padded prompt tokens [B·G, P], mask and answers; rows g·G … g·G + G − 1: prompt g."""
    if group_size <= 0:
        raise ValueError(f"group_size={group_size} must be > 0")
    bos = _bos(tok)
    rows = [bos + _encode(tok, r["prompt"], max_prompt_len - len(bos), "prompt", r)
            for r in records]
    tokens = np.full((len(rows), max_prompt_len), tok.pad_id, np.int32)
    mask = np.zeros((len(rows), max_prompt_len), bool)
    for i, ids in enumerate(rows):
        tokens[i, max_prompt_len - len(ids):] = ids
        mask[i, max_prompt_len - len(ids):] = True
    answers = [r["answer"] for r in records for _ in range(group_size)]
    return PromptBatch(np.repeat(tokens, group_size, axis=0),
                       np.repeat(mask, group_size, axis=0), answers)


def epoch_order(num_records: int, seed: int, epoch: int, stream: int = 0) -> np.ndarray:
    """The record permutation of `epoch`, a pure function of (seed, epoch, `stream`): 0 is
    the training prompts', others independent (dynamic sampling's, rl/dynamic.py)."""
    key = [seed, epoch] if stream == 0 else [seed, epoch, stream]
    return np.random.default_rng(key).permutation(num_records)


def batch_indices(num_records: int, batch_size: int, step: int, seed: int,
                  stream: int = 0) -> np.ndarray:
    """Record indices of batch `step`, pure in (step, seed, stream): resuming draws the same."""
    if num_records <= 0 or batch_size <= 0:
        raise ValueError(f"batch_indices: need {num_records=} > 0 and {batch_size=} > 0")
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_records)
        order = epoch_order(num_records, seed, epoch, stream)
        out.extend(order[offset:offset + batch_size - len(out)].tolist())
    return np.asarray(out)


def epochs(records: Sequence[dict], batch_size: int, seed: int,
           start_step: int = 0) -> Iterator[list[dict]]:
    """Endless seeded batches from `start_step`, reshuffled each epoch (a batch may span two)."""
    if not 0 < batch_size or not len(records):
        raise ValueError(f"epochs: need batch_size > 0 and records, got {batch_size=} "
                         f"and {len(records)} records")
    step = start_step
    while True:
        yield [records[i] for i in batch_indices(len(records), batch_size, step, seed)]
        step += 1

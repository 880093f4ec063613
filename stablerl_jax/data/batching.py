"""Prompt batches for RL (left-padded, G copies per prompt) and SFT batches.

Letters: B rows, P prompt slots, T sequence slots, G group size.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from stablerl_jax.data.tokenizer import Tokenizer


def _encode(tok: Tokenizer, text: str, limit: int, field: str, rec) -> list[int]:
    ids = tok.encode(text)
    if len(ids) > limit:
        raise ValueError(f"record {rec.get('id')}: {field} has {len(ids)} tokens > {limit}; "
                         f"raise task.max_{field}_len or filter the data")
    return ids


def prompt_batch(records: Sequence[dict], tok: Tokenizer, group_size: int,
                 max_prompt_len: int):
    """Left-padded prompt tokens [B·G, P] (BOS first), mask, and answers, each prompt
    repeated G consecutive times (one group)."""
    rows = [[tok.bos_id] + _encode(tok, r["prompt"], max_prompt_len - 1, "prompt", r)
            for r in records]
    tokens = np.full((len(rows), max_prompt_len), tok.pad_id, np.int32)
    mask = np.zeros((len(rows), max_prompt_len), bool)
    for i, ids in enumerate(rows):
        tokens[i, max_prompt_len - len(ids):] = ids
        mask[i, max_prompt_len - len(ids):] = True
    rep = lambda x: np.repeat(x, group_size, axis=0)
    answers = [r["answer"] for r in records for _ in range(group_size)]
    return rep(tokens), rep(mask), answers


def sft_batch(records: Sequence[dict], tok: Tokenizer, max_prompt_len: int,
              max_solution_len: int):
    """Left-padded prompt, then solution + EOS, right-padded to P + solution budget.

    The prompt occupies the same slots as in RL prompt batches, so SFT and RL see the same
    layout. loss_mask is 1 on solution tokens and EOS only.
    """
    p, n = max_prompt_len, max_solution_len + 1
    tokens = np.full((len(records), p + n), tok.pad_id, np.int32)
    attn = np.zeros_like(tokens, bool)
    loss = np.zeros_like(tokens, bool)
    for i, r in enumerate(records):
        prompt = [tok.bos_id] + _encode(tok, r["prompt"], p - 1, "prompt", r)
        sol = _encode(tok, r["solution"], max_solution_len, "solution", r) + [tok.eos_id]
        tokens[i, p - len(prompt):p] = prompt
        tokens[i, p:p + len(sol)] = sol
        attn[i, p - len(prompt):p + len(sol)] = True
        loss[i, p:p + len(sol)] = True
    return {"tokens_BxT": tokens, "attn_BxT": attn, "loss_mask_BxT": loss}


def epoch_order(num_records: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_records)


def batch_indices(num_records: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Record indices of batch `step` in a stream of seeded epoch permutations: a pure
    function of (step, seed), so a resumed run draws exactly the batches it would have."""
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_records)
        order = epoch_order(num_records, seed, epoch)
        out.extend(order[offset:offset + batch_size - len(out)].tolist())
    return np.asarray(out)


def epochs(records: Sequence[dict], batch_size: int, seed: int) -> Iterator[list[dict]]:
    """Endless iterator of batches; reshuffled every epoch, deterministic from seed."""
    step = 0
    while True:
        yield [records[i] for i in batch_indices(len(records), batch_size, step, seed)]
        step += 1

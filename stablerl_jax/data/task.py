"""The task as the trainer sees it: splits, tokenizer, prompt batches, rewards, eval.

Letters: B responses (rows), G responses per prompt, P prompt slots, S rollout slots.

The front door of `data/`: `load_split` dispatches on `TaskConfig.kind` to the arithmetic
builder (synthetic.py) or the JSONL builder (gsm8k.py) and reads the split through its
array_record data source; `TaskData` adds the tokenizer, trained once on the train split
with at most `vocab_size` pieces (the model's), or a checkpoint's own tokenizer.json
(`task.tokenizer_dir`), and the batches the loop needs.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from stablerl_jax import distributed
from stablerl_jax.config import TaskConfig, check
from stablerl_jax.data import batching, gsm8k, rewards, synthetic
from stablerl_jax.data.evaluation import scores, summarize
from stablerl_jax.data.hf_tokenizer import HFTokenizer
from stablerl_jax.data.tokenizer import SentencePieceTokenizer, Tokenizer


def read_source(source) -> list[dict]:
    """All records of a TFDS data source as {field: str}, sorted by id."""
    raw = source.__getitems__(list(range(len(source)))) if len(source) else []
    recs = [{k: v.decode() if isinstance(v, bytes) else str(v) for k, v in r.items()}
            for r in raw]
    return sorted(recs, key=lambda r: r["id"])


def load_split(task: TaskConfig, split: str, data_dir: str) -> list[dict]:
    """Build the task's dataset (once) and read a split: records {id, prompt, solution,
    answer} of str, sorted by id."""
    check(split in ("train", "test"), "split", f"must be 'train' or 'test', got {split!r}")
    if task.kind == "gsm8k":
        b = gsm8k.builder(task.jsonl_dir, data_dir, task.skip_malformed)
    else:
        b = synthetic.builder(task, data_dir)
    return read_source(b.as_data_source()[split])


@dataclasses.dataclass
class TaskData:
    cfg: TaskConfig
    train: list
    test: list
    tokenizer: Tokenizer

    @classmethod
    def create(cls, cfg: TaskConfig, vocab_size: int, data_dir: str) -> "TaskData":
        """Build the splits (once) and train the tokenizer (once) under data_dir."""
        train = load_split(cfg, "train", data_dir)
        test = load_split(cfg, "test", data_dir)
        if cfg.tokenizer_dir:
            tok = HFTokenizer.from_dir(cfg.tokenizer_dir)
            check(tok.vocab_size <= vocab_size, "task.tokenizer_dir",
                  f"the tokenizer has {tok.vocab_size} tokens > model.vocab_size="
                  f"{vocab_size}; use the checkpoint's own tokenizer")
            return cls(cfg, train, test, tok)
        corpus = [r["prompt"] + " " + r["solution"] for r in train]
        name = f"spm_{cfg.kind}_{vocab_size}_{cfg.num_operands}_{cfg.max_digits}.model"
        tok = SentencePieceTokenizer.load_or_train(os.path.join(data_dir, name), corpus,
                                                   vocab_size)
        return cls(cfg, train, test, tok)

    @property
    def reward_kind(self) -> str:
        return "exact" if self.cfg.kind == "arithmetic" else "math_verify"

    def train_indices(self, step: int, batch: int, seed: int) -> np.ndarray:
        """Train-split indices of the prompts of global step `step` (seeded epochs)."""
        return batching.batch_indices(len(self.train), batch, step, seed)

    def prompt_batch(self, records, group_size: int):
        return batching.prompt_batch(records, self.tokenizer, group_size, self.cfg.max_prompt_len)

    def completions(self, rollout) -> list[str]:
        """Decoded completions of this process's rows of a rollout (all rows when the run
        is a single process)."""
        toks = distributed.local_rows(rollout.tokens_BxS)
        comp = distributed.local_rows(rollout.completion_mask_BxS)
        return [self.tokenizer.decode(t[c]) for t, c in zip(toks, comp)]

    def reward(self, rollout, answers) -> np.ndarray:
        """Rewards of this process's rows; `answers` are those rows' reference answers."""
        return rewards.rewards(self.completions(rollout), answers, self.reward_kind)

    def sft_batches(self, batch_size: int, seed: int):
        """Endless seeded epochs of `batching.SFTBatch`es (numpy): this process's block of
        each batch's rows, the only ones it tokenizes."""
        rows = distributed.rows_of_process(batch_size)
        for recs in batching.epochs(self.train, batch_size, seed):
            yield batching.sft_batch(recs[rows], self.tokenizer, self.cfg.max_prompt_len,
                                     self.cfg.max_solution_len)

    def evaluate(self, sample_tokens, key, num_problems: int, k: int) -> dict:
        """avg@k / pass@k on the first `num_problems` test problems (each process samples
        and scores its block of them; the scores are gathered)."""
        problems = self.test[:num_problems][distributed.rows_of_process(num_problems)]
        by_prompt = {r["prompt"]: r for r in problems}

        def sample_fn(prompts: list[str]) -> list[str]:
            recs = [by_prompt[p] for p in prompts]
            tokens, mask, _ = batching.prompt_batch(recs, self.tokenizer, 1,
                                                    self.cfg.max_prompt_len)
            return self.completions(sample_tokens(tokens, mask, key))

        r_nxk = scores(sample_fn, [r["prompt"] for r in problems],
                       [r["answer"] for r in problems], k, rewards.REWARDS[self.reward_kind])
        return summarize(distributed.gather(r_nxk))

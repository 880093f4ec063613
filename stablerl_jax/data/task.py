"""The task as the trainer sees it: splits, eval sets, tokenizer, prompt batches, rewards.
Letters: B responses (rows), G responses per prompt, P prompt slots, S rollout slots.

The front door of `data/`: `load_split` reads a split of the arithmetic (synthetic.py) or
JSONL / parquet (jsonl.py) builder, by `TaskConfig.kind`. `TaskData.create` then:

  1. loads the train split and the eval sets: `rl.eval_sets` ("name:path,…", JSONL or
     parquet files or directories holding test.jsonl or test.parquet, format detected or
     task.format=custom's fields), else the test split as one set named 'test';
  2. builds the tokenizer: the checkpoint's tokenizer.json (`task.tokenizer_dir`), else
     SentencePiece trained once on the train split, at most `vocab_size` pieces;
  3. renders prompts (data/chat_template.py: task.prompt_template, then the chat template
     if task.chat_template; a record's own `chat` as that chat), so batches tokenize
     `record["prompt"]` as is;
  4. drops prompts over task.max_prompt_len tokens (BOS included), counted per split in
     `TaskData.filtered`; a split left empty fails here, before training, naming it, its
     file and the fix.

Records: {id, prompt, question, solution, answer}, all str (`question` raw; a loaded
`chat` is rendered into `prompt` and dropped). `TaskData.evals` maps set names to records,
in the order named. A task without a train file (eval-only) needs `require_train=False`
(offline rollouts carry their own prompts).
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
from etils import epath

from stablerl_jax import distributed
from stablerl_jax.config import TaskConfig, check, parse_eval_sets
from stablerl_jax.data import batching, jsonl, rewards, synthetic
from stablerl_jax.data.answers import opens_think
from stablerl_jax.data.chat_template import prompt_renderer
from stablerl_jax.data.formats import Mapping
from stablerl_jax.data.hf_tokenizer import HFTokenizer
from stablerl_jax.data.tokenizer import SentencePieceTokenizer, Tokenizer


def read_source(source) -> list[dict]:
    """A TFDS data source's records as {field: str}, sorted by id, an empty `chat` dropped."""
    raw = source.__getitems__(list(range(len(source)))) if len(source) else []
    recs = [{k: v.decode() if isinstance(v, bytes) else str(v) for k, v in r.items()}
            for r in raw]
    recs = [{k: v for k, v in r.items() if k != "chat" or v} for r in recs]
    return sorted(recs, key=lambda r: r["id"])


def mapping(task: TaskConfig) -> Mapping:
    """The task's JSONL field mapping (data/formats.py)."""
    return Mapping(task.format, task.prompt_field, task.answer_field, task.solution_field)


def _builder(task: TaskConfig, data_dir: str):
    if task.kind == "arithmetic":
        return synthetic.builder(task, data_dir)
    return jsonl.builder(task.jsonl_dir, data_dir, task.skip_malformed, mapping(task))


def _read(b, task: TaskConfig, split: str) -> list[dict]:
    if split not in b.info.splits:
        raise FileNotFoundError(f"{task.jsonl_dir}: no {split}.jsonl or {split}.parquet; "
                                "put one in task.jsonl_dir (a single file is a test split)"
                                + (", or name eval sets with rl.eval_sets"
                                   if split == "test" else ""))
    return read_source(b.as_data_source()[split])


def load_split(task: TaskConfig, split: str, data_dir: str) -> list[dict]:
    """Build (once) and read a split: str records {id, prompt (raw), solution, answer}, by id."""
    check(split in ("train", "test"), "split", f"must be 'train' or 'test', got {split!r}")
    return _read(_builder(task, data_dir), task, split)


def _eval_file(path: str, jsonl_dir: str = "") -> str:
    """An eval set's file (JSONL, or parquet by name): `path`, or a directory's test.jsonl /
    test.parquet. A relative path is looked up in task.jsonl_dir first (so a preset can
    name `aime24:aime24.jsonl` beside the training data), then the working directory."""
    tried = []
    base = jsonl_dir if epath.Path(jsonl_dir).is_dir() else os.path.dirname(jsonl_dir)
    in_dir = ([os.path.join(base, path)] if base and not os.path.isabs(path)
              and "://" not in path else [])
    for cand in in_dir + [path]:
        if epath.Path(cand).is_dir():
            cand = (jsonl.split_file(cand, "test", "rl.eval_sets")
                    or os.path.join(cand, "test.jsonl"))
        if epath.Path(cand).is_file():
            return cand
        tried.append(cand)
    raise FileNotFoundError(f"rl.eval_sets: {path}: no such file (tried {', '.join(tried)}); "
                            "each set is a JSONL or parquet file or a directory holding "
                            "test.jsonl or test.parquet, a relative path taken in "
                            "task.jsonl_dir or the working directory")


def load_sets(task: TaskConfig, data_dir: str, eval_sets: str, require_train: bool
              ) -> tuple[list[dict], dict[str, list[dict]], dict[str, str]]:
    """(train, {set: records}, {split or set: source}), prompts raw (module step 1)."""
    b = _builder(task, data_dir)
    where = task.jsonl_dir or f"the {task.kind} task"
    sources = {s: where for s in b.info.splits}
    if "train" in b.info.splits:
        train = read_source(b.as_data_source()["train"])
    elif require_train:
        raise FileNotFoundError(f"{task.jsonl_dir}: no train.jsonl, and a training run "
                                "needs one; add it (or train.parquet), or train on "
                                "rl.offline_rollouts")
    else:
        train = []
    if task.kind != "arithmetic" and distributed.is_main():
        meta = b.info.metadata
        skipped = meta.get("skipped_counts", {})
        print(f"data: {where}: " + ", ".join(
            f"{s} read as format {f!r} ({skipped.get(s, 0)} malformed skipped)"
            for s, f in meta.get("formats", {}).items()), flush=True)
    named = parse_eval_sets(eval_sets)
    if not named:
        return train, {"test": _read(b, task, "test")}, sources
    evals = {}
    eval_mapping = mapping(task) if task.format == "custom" else Mapping("auto")
    for name, path in named.items():
        sources[name] = path = _eval_file(path, task.jsonl_dir)
        parsed = jsonl.parse_jsonl(path, task.skip_malformed, name, eval_mapping)
        if distributed.is_main():
            print(f"data: eval set {name!r}: {path} read as format {parsed.format!r} "
                  f"({len(parsed.records)} problems, {parsed.skipped} malformed skipped)",
                  flush=True)
        evals[name] = parsed.records
    return train, evals, sources


def _tokenizer(cfg: TaskConfig, vocab_size: int, data_dir: str, corpus) -> Tokenizer:
    if cfg.tokenizer_dir:
        tok = HFTokenizer.from_dir(cfg.tokenizer_dir)
        check(tok.vocab_size <= vocab_size, "task.tokenizer_dir",
              f"the tokenizer has {tok.vocab_size} tokens > model.vocab_size="
              f"{vocab_size}; use the checkpoint's own tokenizer")
        return tok
    steps = f"_x{cfg.max_steps}" if cfg.max_steps else ""
    name = f"spm_{cfg.kind}_{vocab_size}_{cfg.num_operands}_{cfg.max_digits}{steps}.model"
    return SentencePieceTokenizer.load_or_train(os.path.join(data_dir, name), corpus,
                                                vocab_size)


def _prompt(record: dict) -> str | list[dict]:
    """What a record's prompt renders from: its own chat if it has one, else the question."""
    return json.loads(record["chat"]) if record.get("chat") else record["prompt"]


def _fit(records: list[dict], render, tok: Tokenizer, cfg: TaskConfig, name: str,
         source: str) -> tuple[list[dict], int]:
    """Rendered records that fit task.max_prompt_len, and how many did not (step 4)."""
    rendered = [{**{k: v for k, v in r.items() if k != "chat"}, "question": r["prompt"],
                 "prompt": render(_prompt(r))} for r in records]
    kept, dropped = batching.split_by_length(rendered, tok, cfg.max_prompt_len)
    if dropped and distributed.is_main():
        print(f"data: {name}: dropped {dropped} of {len(rendered)} prompts longer than "
              f"task.max_prompt_len={cfg.max_prompt_len} tokens (template included)",
              flush=True)
    if rendered and not kept:
        raise ValueError(f"{source}: every one of the {len(rendered)} {name} prompts is "
                         f"longer than task.max_prompt_len={cfg.max_prompt_len} tokens once "
                         "rendered; raise task.max_prompt_len (or shorten the template)")
    return kept, dropped


@dataclasses.dataclass
class TaskData:
    cfg: TaskConfig
    train: list
    evals: dict            # {set name: records}, in the order named
    tokenizer: Tokenizer
    filtered: dict         # {split or set name: prompts dropped as over-long}
    response_prefix: str = ""  # "<think>" when the rendered prompt opens a think block

    @classmethod
    def create(cls, cfg: TaskConfig, vocab_size: int, data_dir: str, eval_sets: str = "",
               require_train: bool = True) -> "TaskData":
        """Load, tokenize, render and filter (module docstring) under data_dir."""
        train, evals, sources = load_sets(cfg, data_dir, eval_sets, require_train)
        render = prompt_renderer(cfg)
        corpus_recs = train or [r for recs in evals.values() for r in recs]
        tok = _tokenizer(cfg, vocab_size, data_dir,
                         [render(_prompt(r)) + " " + r["solution"] for r in corpus_recs])
        filtered = {}
        train, filtered["train"] = _fit(train, render, tok, cfg, "train",
                                        sources.get("train", ""))
        for name in evals:
            evals[name], filtered[name] = _fit(evals[name], render, tok, cfg, name,
                                               sources.get(name, sources.get("test", "")))
        prefix = "<think>" if opens_think(render("?")) else ""
        return cls(cfg, train, evals, tok, filtered, prefix)

    @property
    def reward_kind(self) -> str:
        return "exact" if self.cfg.kind == "arithmetic" else "math_verify"

    def train_indices(self, step: int, batch: int, seed: int, stream: int = 0) -> np.ndarray:
        """Train-split indices of global step `step`'s prompts (seeded epochs); a nonzero
        `stream` is an independent sequence (dynamic sampling's rounds, rl/dynamic.py)."""
        return batching.batch_indices(len(self.train), batch, step, seed, stream)

    def prompt_batch(self, records, group_size: int):
        return batching.prompt_batch(records, self.tokenizer, group_size, self.cfg.max_prompt_len)

    def completions(self, rollout) -> list[str]:
        """Decoded completions of this process's rows of a rollout (all, in one process)."""
        toks = distributed.local_rows(rollout.tokens_BxS)
        comp = distributed.local_rows(rollout.completion_mask_BxS)
        return [self.tokenizer.decode(t[c]) for t, c in zip(toks, comp)]

    def scored_texts(self, completions) -> list[str]:
        """Completions behind `response_prefix`: a response to a prompt that opened
        `<think>` is not scored from inside its think block."""
        return [self.response_prefix + c for c in completions]

    def reward_with_source(self, rollout, answers) -> tuple[np.ndarray, list[str]]:
        """(rewards, answer extractor) of this process's rows, given their `answers`."""
        return rewards.rewards_with_source(self.scored_texts(self.completions(rollout)),
                                           answers, self.reward_kind)

    def reward(self, rollout, answers) -> np.ndarray:
        """Rewards of this process's rows, given their reference `answers`."""
        return self.reward_with_source(rollout, answers)[0]

"""The RL task: `TaskConfig` (data, prompt format and token budgets)."""
from __future__ import annotations

import dataclasses

from stablerl_jax.config.checks import (check, is_int, check_positive_int, check_choice,
                                        check_bool, is_finite, Section)
from stablerl_jax.config.choices import TASK_KINDS, DATA_FORMATS, STYLES, OPERATORS


@dataclasses.dataclass(frozen=True)
class TaskConfig(Section):
    """The RL task: data, prompt format and prompt/solution token budgets.

    kind: 'arithmetic' (data/synthetic.py) or 'jsonl' (JSONL math, data/jsonl.py; alias 'gsm8k').
    num_operands / max_digits / operators / modulus: arithmetic difficulty.
    min_steps / max_steps: max_steps > 0: long problems (data/synthetic.py), the num_operands − 1
      operations looped for a step count drawn from [min_steps, max_steps]; 0: one pass.
    style: worked-solution style for SFT: 'steps', 'rewrite' or 'terse'.
    num_train / num_test: records per split (arithmetic only; JSONL files set their own).
    test_fraction: share of the problem space hashed into the test split. seed: the generator's.
    max_prompt_len / max_solution_len: token budgets (longer rendered prompts: dropped, counted).
    jsonl_dir: kind='jsonl': a dir with train.jsonl and/or test.jsonl (or train.parquet /
      test.parquet, verl's layout: data/parquet.py), or one .jsonl or .parquet file (eval-only).
    format: how a JSONL record (parquet row) maps to (question, answer) (data/formats.py): 'auto'
      (the one named format whose fields the file has), 'gsm8k', 'math', 'dapo', 'aime',
      'prompt_answer', or 'custom' with prompt_field / answer_field (/ solution_field).
    tokenizer_dir: a directory with a checkpoint's tokenizer.json (and tokenizer_config.json),
      whose tokenizer and special ids are used; '': train a SentencePiece tokenizer on the task.
    skip_malformed: kind='jsonl': skip (and count) malformed JSONL lines instead of failing.
    chat_template: render prompts with tokenizer_dir's jinja template (data/chat_template.py);
      needs tokenizer_dir at load (`experiments.train --hf` sets it).
    system_prompt: a system message ('' = none; needs chat_template).
    prompt_template: the user message, "{question}" replaced by the question.
    enable_thinking / add_generation_prompt: passed to the chat template."""

    kind: str = "arithmetic"
    num_operands: int = 4
    max_digits: int = 1
    operators: str = "+-"
    modulus: int = 0
    min_steps: int = 0
    max_steps: int = 0
    style: str = "steps"
    num_train: int = 4000
    num_test: int = 400
    test_fraction: float = 0.1
    seed: int = 0
    max_prompt_len: int = 16
    max_solution_len: int = 40
    jsonl_dir: str = ""
    tokenizer_dir: str = ""
    skip_malformed: bool = False
    format: str = "auto"
    prompt_field: str = ""
    answer_field: str = ""
    solution_field: str = ""
    chat_template: bool = False
    system_prompt: str = ""
    prompt_template: str = "{question}"
    enable_thinking: bool = True
    add_generation_prompt: bool = True

    def __post_init__(self):
        check_choice(self, "kind", TASK_KINDS)
        check_positive_int(self, "num_operands", "max_digits", "num_train", "num_test",
                           "max_prompt_len", "max_solution_len")
        check(self.num_operands >= 2, "num_operands", f"must be >= 2, got {self.num_operands}")
        check(self.max_digits <= 6, "max_digits", f"must be <= 6, got {self.max_digits}")
        check_choice(self, "operators", OPERATORS)
        check(is_int(self.modulus) and (self.modulus == 0 or self.modulus >= 2),
              "modulus", f"must be 0 (no modulus) or an int >= 2, got {self.modulus!r}")
        check_choice(self, "style", STYLES)
        check(is_int(self.max_steps) and self.max_steps >= 0, "max_steps",
              f"must be an int >= 0 (0 = no long problems), got {self.max_steps!r}")
        check(is_int(self.min_steps) and (self.min_steps == 0 if not self.max_steps else
                                          1 <= self.min_steps <= self.max_steps),
              "min_steps", f"must be in [1, max_steps={self.max_steps}] for long problems, "
              f"or 0 with max_steps=0; got {self.min_steps!r}")
        check(not self.max_steps or self.style != "rewrite", "style",
              "'rewrite' has no long-problem form; use 'steps' or 'terse' with max_steps > 0")
        check(is_finite(self.test_fraction) and 0 < self.test_fraction < 1, "test_fraction",
              f"must be in (0, 1), got {self.test_fraction}")
        check(is_int(self.seed) and self.seed >= 0, "seed",
              f"must be an int >= 0, got {self.seed!r}")
        check(self.kind == "arithmetic" or bool(self.jsonl_dir), "jsonl_dir",
              f"must name the directory holding train.jsonl / test.jsonl or train.parquet "
              f"/ test.parquet (or one such file) when kind={self.kind!r}")
        check_bool(self, "skip_malformed", "chat_template", "enable_thinking",
                   "add_generation_prompt")
        check_choice(self, "format", DATA_FORMATS)
        custom = ("prompt_field", "answer_field", "solution_field")
        for name in custom + ("system_prompt", "prompt_template"):
            check(isinstance(getattr(self, name), str), name,
                  f"must be a string, got {getattr(self, name)!r}")
        if self.format == "custom":
            check(bool(self.prompt_field) and bool(self.answer_field), "format",
                  "'custom' needs task.prompt_field and task.answer_field (the JSONL keys "
                  "of the question and the answer)")
        else:
            for name in custom:
                check(not getattr(self, name), name,
                      f"is only read with task.format=custom, got format={self.format!r}; "
                      "set task.format=custom or drop it")
        check("{question}" in self.prompt_template, "prompt_template",
              f"must contain '{{question}}' (where the question goes), got "
              f"{self.prompt_template!r}")
        check(not self.system_prompt or self.chat_template, "system_prompt",
              "is a chat message, so it needs task.chat_template=true; set it or drop the "
              "system prompt")

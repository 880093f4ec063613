"""Cold-start (SFT) data: records → chats → token ids and which of them carry the loss.

Letters: B rows, P prompt slots (task.max_prompt_len), R response slots
(task.max_solution_len + 1: the response and its stop token).

`sft.data`: a JSONL or parquet file (by a `.parquet` name, data/parquet.py) or a directory
holding train.jsonl or train.parquet, never both; `sft.format=auto` picks by the first record:

    messages         {"messages": [{"role": …, "content": str}, …]}: an OpenAI / Hugging
                     Face chat (in parquet, {role, content} structs), as written; every
                     assistant turn is trained, every other token is context
    prompt_response  {"prompt": str, "response": str}
    gsm8k, math      data/formats.py's, question as prompt, worked solution as response

`sft.data=''` trains on the task's training split and its worked solutions. Prompts become
user turns as in RL (task.prompt_template, task.system_prompt:
`chat_template.prompt_messages`), so the cold start sees the prompts RL will.

Without a chat template (task.chat_template off) an example is BOS + prompt (context),
then response + EOS (trained); `messages` records need one. With it, assistant turn i is
the text between

    pre_i   = render(messages[:i], add_generation_prompt=True)    (its generation prompt)
    upto_i  = render(messages[:i + 1], add_generation_prompt=False)

up to and including the first stop id (Qwen3's `<|im_end|>`); what follows is context.
Context and turns are tokenized apart, as in RL (the prompt alone, the response the
model's own tokens). If every upto_i prefixes the whole chat's rendering, the chat is one
example, a trained span per turn; a template that rewrites earlier turns (Qwen3 drops
thinking before the last user message) makes each turn an example, only turn i trained.
Examples (`Example`) over P or R are dropped at load and counted (`load` prints it); none
left is an error naming the source and the fix.
"""
from __future__ import annotations

import os
from typing import Iterator, NamedTuple, Sequence

import numpy as np
from etils import epath

from stablerl_jax import distributed
from stablerl_jax.data import batching, formats, jsonl
from stablerl_jax.data.batching import SFTBatch
from stablerl_jax.data.chat_template import (ChatTemplate, chat_messages, prompt_messages,
                                             task_template, user_text)
from stablerl_jax.data.formats import Mapping
from stablerl_jax.data.tokenizer import Tokenizer


class Example(NamedTuple):
    prompt: np.ndarray    # int32, the tokens before the first trained one (BOS first)
    response: np.ndarray  # int32, the rest: turns, their stop tokens, later context
    trained: np.ndarray   # bool, per response token: carries the loss


class SFTData(NamedTuple):
    examples: list        # [Example], in record order
    source: str           # the file read, or "the <task> train split"
    format: str
    dropped: dict         # {"prompt": n, "response": n}: examples over the budgets
    skipped: int          # malformed lines skipped (task.skip_malformed)


def _detect(obj: dict, where: str) -> str:
    if isinstance(obj.get("messages"), list):
        return "messages"
    if isinstance(obj.get("prompt"), str) and isinstance(obj.get("response"), str):
        return "prompt_response"
    fits = [f for f, ok in formats.fits(obj).items() if ok and f in ("gsm8k", "math")]
    if len(fits) == 1:
        return fits[0]
    raise formats.NoFormatError(
        f"{where}: no cold-start format fits the fields {sorted(obj)} (messages: a chat "
        "list of {role, content}; prompt_response: prompt + response; gsm8k: question + "
        "answer with '#### N'; math: problem + solution); write one of them, or name "
        "sft.format")


def _messages(obj: dict) -> list[dict]:
    chat = chat_messages(obj["messages"], "messages")
    if not any(m["role"] == "assistant" and m["content"] for m in chat):
        raise ValueError("'messages' has no assistant turn with content to train on")
    return chat


def read_record(obj: dict, where: str, mapping: Mapping) -> tuple[dict, str]:
    """(record, format) of one parsed line or row (`where`): {"messages": chat} or
    {"prompt", "response"}; raises if malformed (data/jsonl.py's `parse_jsonl` names it)."""
    fmt = mapping.format if mapping.format != "auto" else _detect(obj, where)
    if fmt == "messages":
        return {"messages": _messages(obj)}, fmt
    if fmt == "prompt_response":
        prompt, response = formats.text(obj, "prompt"), formats.text(obj, "response")
    else:
        prompt, response, _ = formats.read_record(obj, Mapping(fmt))
    if not response.strip():
        raise ValueError("the response (worked solution) is empty")
    return {"prompt": prompt, "response": response}, fmt


def data_file(path: str) -> str:
    """sft.data's file: `path`, or a directory's train.jsonl / train.parquet."""
    file = path
    if epath.Path(path).is_dir():
        file = (jsonl.split_file(path, "train", "sft.data")
                or os.path.join(path, "train.jsonl"))
    if not epath.Path(file).is_file():
        raise FileNotFoundError(f"sft.data: {file}: no such file; name a JSONL or parquet "
                                "file of messages or prompt/response records, or a "
                                "directory holding train.jsonl or train.parquet")
    return file


class Encoder:
    """Records → examples (module docstring) with a task's tokenizer and template."""

    def __init__(self, task, tok: Tokenizer, template: ChatTemplate | None = None):
        self.task, self.tok, self.template = task, tok, template
        self.bos = [] if tok.bos_id is None else [tok.bos_id]

    def chat(self, rec: dict) -> list[dict]:
        if "messages" in rec:
            return rec["messages"]
        return prompt_messages(self.task, rec["prompt"]) + [
            {"role": "assistant", "content": rec["response"]}]

    def encode(self, rec: dict) -> list[Example]:
        if self.template is None:
            if "messages" in rec:
                raise ValueError(
                    "messages records need a chat template to be rendered; set "
                    "task.chat_template=true with the checkpoint's tokenizer (--hf or "
                    "task.tokenizer_dir), or write prompt/response records")
            prompt = self.bos + self.tok.encode(user_text(self.task, rec["prompt"]))
            response = self.tok.encode(rec["response"]) + [self.tok.eos_id]
            return [_example(prompt, response, [True] * len(response))]
        return self._encode_chat(self.chat(rec))

    def _render(self, messages, generation: bool) -> str:
        return self.template.render(messages, add_generation_prompt=generation,
                                    enable_thinking=self.task.enable_thinking)

    def _turn(self, text: str) -> tuple[list[int], list[int]]:
        """(the turn's tokens up to and including its first stop id, the rest)."""
        ids = self.tok.encode(text)
        stops = [k for k, t in enumerate(ids) if t in self.tok.stop_ids]
        if not stops:
            raise ValueError(f"{self.template.origin}: the template ends an assistant turn "
                             f"with no stop id ({text[-40:]!r}); the model would never "
                             "learn to stop: use the checkpoint's own template")
        return ids[:stops[0] + 1], ids[stops[0] + 1:]

    def _encode_chat(self, messages: list[dict]) -> list[Example]:
        full = self._render(messages, generation=False)
        turns = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            pre, upto = self._render(messages[:i], True), self._render(messages[:i + 1], False)
            if not upto.startswith(pre):
                raise ValueError(
                    f"assistant turn {i}: the template renders it as {upto[len(pre) - 20:][:60]!r}, "
                    f"which does not start with its generation prompt ending "
                    f"{pre[-20:]!r} (task.enable_thinking=false adds an empty think block a "
                    "response with its own thinking does not have); fix the data or the "
                    "setting")
            turns.append((pre, upto))
        in_place = all(full.startswith(upto) for _, upto in turns)
        if not in_place:  # the template rewrites earlier turns: one example per turn
            return [self._pieces([(pre, upto)], pre) for pre, upto in turns]
        return [self._pieces(turns, full)]

    def _pieces(self, turns, text: str) -> Example:
        ids, trained, pos = list(self.bos), [False] * len(self.bos), 0
        for j, (pre, upto) in enumerate(turns):
            context = self.tok.encode(text[pos:len(pre)])
            turn, rest = self._turn(upto[len(pre):])
            rest = rest if j + 1 < len(turns) else []  # nothing after the last turn
            ids += context + turn + rest
            trained += [False] * len(context) + [True] * len(turn) + [False] * len(rest)
            pos = len(upto)
        first = trained.index(True)
        return _example(ids[:first], ids[first:], trained[first:])


def _example(prompt, response, trained) -> Example:
    return Example(np.asarray(prompt, np.int32), np.asarray(response, np.int32),
                   np.asarray(trained, bool))


def _task_records(data) -> list[dict]:
    """The task's training split as prompt/response records (its worked solutions)."""
    recs = [{"prompt": r.get("question", r["prompt"]), "response": r["solution"]}
            for r in data.train if r["solution"].strip()]
    if not recs:
        raise ValueError(f"sft: the training split of {data.cfg.jsonl_dir or data.cfg.kind} "
                         "has no worked solutions to train on; name cold-start data with "
                         "sft.data=FILE (messages or prompt/response records), or set "
                         "sft.steps=0")
    return recs


def load(cfg, data) -> SFTData:
    """The cold start's examples (module docstring) for `cfg` and its loaded TaskData `data`."""
    task, sft = cfg.task, cfg.sft
    if sft.data:
        source = data_file(sft.data)
        parsed = jsonl.parse_jsonl(source, task.skip_malformed, "sft", Mapping(sft.format),
                                   record=read_record, needs="record with a response",
                                   format_field="sft.format")
        records, fmt, skipped = parsed.records, parsed.format, parsed.skipped
    else:
        source = f"the {task.jsonl_dir or task.kind} train split"
        records, fmt, skipped = _task_records(data), "task", 0
    encoder = Encoder(task, data.tokenizer, task_template(task) if task.chat_template else None)
    examples, dropped = [], {"prompt": 0, "response": 0}
    limit = {"prompt": task.max_prompt_len, "response": task.max_solution_len + 1}
    for rec in records:
        try:
            encoded = encoder.encode(rec)
        except ValueError as e:
            raise ValueError(f"{source}: record {rec.get('id', '')}: {e}") from None
        for ex in encoded:
            over = [k for k in ("prompt", "response") if len(getattr(ex, k)) > limit[k]]
            if over:
                dropped[over[0]] += 1
            else:
                examples.append(ex)
    total = len(examples) + sum(dropped.values())
    if distributed.is_main():
        print(f"data: sft: {source} read as {fmt!r}: {total} examples, {len(examples)} kept"
              f" ({dropped['prompt']} with a prompt over task.max_prompt_len="
              f"{task.max_prompt_len} tokens, {dropped['response']} with a response over "
              f"task.max_solution_len+1={limit['response']}, {skipped} malformed skipped)",
              flush=True)
    if not examples:
        raise ValueError(f"{source}: none of the {total} cold-start examples fits the token "
                         f"budgets (prompt <= task.max_prompt_len={task.max_prompt_len}, "
                         f"response + stop token <= task.max_solution_len+1="
                         f"{limit['response']}); raise them or shorten the data")
    return SFTData(examples, source, fmt, dropped, skipped)


def sft_batch(examples: Sequence[Example], pad_id: int, max_prompt_len: int,
              max_solution_len: int) -> SFTBatch:
    """[B, P + R] rows: the prompt left-padded into the P slots RL prompts use, the response
    right after, right-padded. mask_BxT[:, t] = 1 where tokens[:, t + 1] is trained."""
    p, r = max_prompt_len, max_solution_len + 1
    tokens = np.full((len(examples), p + r), pad_id, np.int32)
    attn = np.zeros_like(tokens, bool)
    loss = np.zeros_like(tokens, bool)
    for i, ex in enumerate(examples):
        n = len(ex.response)
        if len(ex.prompt) > p or n > r:
            raise ValueError(f"an example of {len(ex.prompt)} + {n} tokens does not fit "
                             f"{p} + {r} slots; filter with sft_data.load")
        tokens[i, p - len(ex.prompt):p] = ex.prompt
        tokens[i, p:p + n] = ex.response
        attn[i, p - len(ex.prompt):p + n] = True
        loss[i, p:p + n] = ex.trained
    return SFTBatch(tokens, attn, loss[:, 1:].astype(np.float32))


def batches(examples: Sequence[Example], batch_size: int, seed: int, pad_id: int,
            max_prompt_len: int, max_solution_len: int,
            start_step: int = 0) -> Iterator[SFTBatch]:
    """Endless seeded SFT batches from batch `start_step`, each this process's block of rows."""
    rows = distributed.rows_of_process(batch_size)
    for exs in batching.epochs(examples, batch_size, seed, start_step):
        yield sft_batch(exs[rows], pad_id, max_prompt_len, max_solution_len)

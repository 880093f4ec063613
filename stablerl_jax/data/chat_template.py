"""Prompts as the checkpoint expects them: its own jinja chat template, rendered as
Hugging Face transformers renders it (`apply_chat_template`), plus the task's wording:

    user    = task.prompt_template with "{question}" replaced by the question
              (plain replacement: `\\boxed{}` in the wording needs no escaping)
    prompt  = chat_template(messages=[{system: task.system_prompt}?, {user: user}],
              add_generation_prompt=task.add_generation_prompt,
              enable_thinking=task.enable_thinking, <the tokenizer's special tokens>)

when `task.chat_template` is on, else `user` (the synthetic task and the SentencePiece
tokenizer have no template). A record's own chat (verl's [{role, content}, …], e.g. with a
system message) renders as written, task.prompt_template applied to its last user
message, task.system_prompt first only if it has no system message (the record's wins);
without a template it is `user` of its last user message (a system message needs one).
The template is the directory's `chat_template.jinja`, else tokenizer_config.json's
"chat_template" (a string, or a list of {name, template}: "default"), as transformers reads.

Rendering matches transformers' (data/template_sandbox.py: `ImmutableSandboxedEnvironment`
with trim_blocks, lstrip_blocks, loopcontrols, the `{% generation %}` tag, a `tojson` that
does not escape HTML, `raise_exception`, `strftime_now`); special tokens (`<|im_start|>`,
…) encode as single ids. The template is the checkpoint's code, so a render is bounded
(`RenderLimits`: 10 s; strings up to 2^22 = 4,194,304 characters, 100,000 items,
65,536-bit integers). A template that fails to compile, render or keep within a limit is a
one-line `ChatTemplateError` naming the file (and limit), raised when the data loads.
"""
from __future__ import annotations

import os
from typing import Callable

from stablerl_jax.config import TaskConfig, check
from stablerl_jax.data.hf_tokenizer import read_json, token_text
from stablerl_jax.data.template_sandbox import (BoundedEnvironment, RenderLimitError,
                                                RenderLimits)

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                 "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A chat template is missing, does not compile, or fails to render."""


def _brief(e: Exception, limit: int = 300) -> str:
    """`e`'s message on one line, cut to `limit` characters (raise_exception takes any text)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "…"


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict, origin: str,
                 limits: RenderLimits = RenderLimits()):
        self.origin = origin
        self.special_tokens = dict(special_tokens)
        self.environment = BoundedEnvironment(limits)
        try:
            self.template = self.environment.from_string(source)
        except Exception as e:  # noqa: BLE001 - any jinja error: name the file
            raise ChatTemplateError(f"{origin}: the chat template does not compile "
                                    f"({_brief(e)}); fix the template or set "
                                    "task.chat_template=false") from None

    @classmethod
    def from_dir(cls, path: str, limits: RenderLimits = RenderLimits()) -> "ChatTemplate":
        """The template of a tokenizer directory (module docstring)."""
        cfg_file = os.path.join(path, "tokenizer_config.json")
        tcfg = read_json(cfg_file)
        special = {k: token_text(tcfg[k]) for k in _SPECIAL_KEYS if tcfg.get(k)}
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file) as f:
                return cls(f.read(), special, jinja_file, limits)
        source = tcfg.get("chat_template")
        if isinstance(source, list):  # [{name, template}, …]: transformers takes "default"
            source = {t.get("name"): t.get("template") for t in source
                      if isinstance(t, dict)}.get("default")
        if not isinstance(source, str) or not source:
            raise ChatTemplateError(f"{cfg_file}: no chat_template (and no "
                                    f"{jinja_file}); use the checkpoint's own tokenizer "
                                    "files or set task.chat_template=false")
        return cls(source, special, cfg_file, limits)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               **kwargs) -> str:
        """`messages` rendered; kwargs (e.g. enable_thinking) override the special tokens."""
        try:
            return self.environment.render(self.template, messages=messages, tools=None,
                                           documents=None,
                                           add_generation_prompt=add_generation_prompt,
                                           **{**self.special_tokens, **kwargs})
        except RenderLimitError as e:
            raise ChatTemplateError(f"{self.origin}: the chat template {e}; fix the "
                                    "template or set task.chat_template=false") from None
        except Exception as e:  # noqa: BLE001 - any render error: name the file
            raise ChatTemplateError(f"{self.origin}: the chat template failed to render "
                                    f"({type(e).__name__}: {_brief(e)}); fix the template "
                                    "or set task.chat_template=false") from None


def chat_messages(value, field: str) -> list[dict]:
    """A record's chat `value` as [{role, content}] (other keys dropped: a parquet struct
    has every message's keys, None where unset); else TypeError naming `field`."""
    if not isinstance(value, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in value):
        raise TypeError(f"'{field}' must be a list of {{'role': str, 'content': str}}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _last_user(chat: list[dict]) -> int:
    users = [i for i, m in enumerate(chat) if m["role"] == "user"]
    if not users:
        raise ValueError("a prompt chat needs a user message (the question)")
    return users[-1]


def user_text(task: TaskConfig, question: str | list[dict]) -> str:
    """task.prompt_template with "{question}" replaced by a question (a chat's last user one)."""
    if not isinstance(question, str):
        question = question[_last_user(question)]["content"]
    return task.prompt_template.replace("{question}", question)


def prompt_messages(task: TaskConfig, question: str | list[dict]) -> list[dict]:
    """A question's chat: task.system_prompt (if any), the user message (module docstring)."""
    chat = [{"role": "user", "content": question}] if isinstance(question, str) else question
    last = _last_user(chat)
    chat = chat[:last] + [{"role": "user", "content": user_text(task, chat[last]["content"])}
                          ] + chat[last + 1:]
    own = any(m["role"] == "system" for m in chat)
    system = ([{"role": "system", "content": task.system_prompt}]
              if task.system_prompt and not own else [])
    return system + chat


def task_template(task: TaskConfig) -> ChatTemplate:
    """The template of task.tokenizer_dir, which task.chat_template needs."""
    check(bool(task.tokenizer_dir), "task.chat_template",
          "renders the checkpoint's template, so it needs task.tokenizer_dir (the "
          "directory with tokenizer_config.json; `experiments.train --hf DIR` sets "
          "it); set it or task.chat_template=false")
    return ChatTemplate.from_dir(task.tokenizer_dir)


def prompt_renderer(task: TaskConfig) -> Callable[[str | list[dict]], str]:
    """question (or a chat) -> prompt text; one render here makes a bad template fail at load."""
    if not task.chat_template:
        return lambda question: user_text(task, question)
    template = task_template(task)

    def render(question: str | list[dict]) -> str:
        return template.render(prompt_messages(task, question),
                               add_generation_prompt=task.add_generation_prompt,
                               enable_thinking=task.enable_thinking)

    render("1 + 1 = ?")
    return render

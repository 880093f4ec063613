"""Prompts as the checkpoint expects them: its own jinja chat template, rendered as
Hugging Face transformers renders it (`apply_chat_template`), plus the task's wording.

A question becomes the final prompt text in two steps:

    user    = task.prompt_template with "{question}" replaced by the question
              (plain replacement: `\\boxed{}` in the wording needs no escaping)
    prompt  = chat_template(messages=[{system: task.system_prompt}?, {user: user}],
              add_generation_prompt=task.add_generation_prompt,
              enable_thinking=task.enable_thinking, <the tokenizer's special tokens>)

when `task.chat_template` is on; otherwise the prompt is `user` itself (the synthetic
task and the SentencePiece tokenizer have no template). A record whose prompt is its own
chat (verl's layout: [{role, content}, …], e.g. a system message before the question)
renders as those messages, as written, with task.prompt_template applied to the last
user message and task.system_prompt put first only when the chat has no system message
of its own (the record's wins), then the generation prompt; without a template such a
prompt is `user` made from its last user message (a system message needs a template,
as task.system_prompt does). The template is the directory's `chat_template.jinja` if
present, else tokenizer_config.json's "chat_template" (a string, or a list of {name,
template} from which "default" is taken), as transformers reads it.

Rendering matches transformers': a sandboxed `ImmutableSandboxedEnvironment` with
trim_blocks and lstrip_blocks, the loopcontrols extension and the `{% generation %}` tag
(rendered as its body), a `tojson` filter that does not escape HTML, and the globals
`raise_exception` and `strftime_now`. The rendered text holds
special tokens (`<|im_start|>`, …) that the tokenizer encodes as single ids. A template
that fails to compile or render is an error naming the file, raised when the data loads.

Limits (data/template_sandbox.py, `RenderLimits`): a template is code from the
checkpoint, so each render is bounded. It may run 10 s (checked at every loop iteration,
call, filter and output chunk, in any thread), render at most 2^22 = 4,194,304
characters, build no string longer than that, no list or range() of over 100,000 items,
and no integer of over 65,536 bits by * or **; sizes are checked before the operation
that would exceed them. A render past a limit is a one-line `ChatTemplateError` naming
the file and the limit.
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
    """An exception's message on one line, cut to `limit` characters (a template's
    raise_exception may be handed any text)."""
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
        """The template's text for `messages`; kwargs (e.g. enable_thinking) override the
        special tokens, as in transformers."""
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
    carries every key any message has, as None elsewhere); TypeError naming `field` when
    it is not a list of {'role': str, 'content': str}."""
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
    """The user message of a question (of a chat: its last user message):
    task.prompt_template with "{question}" replaced."""
    if not isinstance(question, str):
        question = question[_last_user(question)]["content"]
    return task.prompt_template.replace("{question}", question)


def prompt_messages(task: TaskConfig, question: str | list[dict]) -> list[dict]:
    """The chat of a question: task.system_prompt (if any), then the user message. Of a
    record's own chat: its messages, the last user one through task.prompt_template,
    task.system_prompt first only when the chat has no system message (module
    docstring)."""
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
    """question (or a record's own chat) -> final prompt text (module docstring). The
    template is loaded and rendered once here, so a broken one fails when the data
    loads."""
    if not task.chat_template:
        return lambda question: user_text(task, question)
    template = task_template(task)

    def render(question: str | list[dict]) -> str:
        return template.render(prompt_messages(task, question),
                               add_generation_prompt=task.add_generation_prompt,
                               enable_thinking=task.enable_thinking)

    render("1 + 1 = ?")
    return render

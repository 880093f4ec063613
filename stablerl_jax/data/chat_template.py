"""Prompts as the checkpoint expects them: its own jinja chat template, rendered as
Hugging Face transformers renders it (`apply_chat_template`), plus the task's wording.

A question becomes the final prompt text in two steps:

    user    = task.prompt_template with "{question}" replaced by the question
              (plain replacement: `\\boxed{}` in the wording needs no escaping)
    prompt  = chat_template(messages=[{system: task.system_prompt}?, {user: user}],
              add_generation_prompt=task.add_generation_prompt,
              enable_thinking=task.enable_thinking, <the tokenizer's special tokens>)

when `task.chat_template` is on; otherwise the prompt is `user` itself (the synthetic
task and the SentencePiece tokenizer have no template). The template is the directory's
`chat_template.jinja` if present, else tokenizer_config.json's "chat_template" (a string,
or a list of {name, template} from which "default" is taken), as transformers reads it.

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


def user_text(task: TaskConfig, question: str) -> str:
    """The user message of a question: task.prompt_template with "{question}" replaced."""
    return task.prompt_template.replace("{question}", question)


def prompt_messages(task: TaskConfig, question: str) -> list[dict]:
    """The chat of a question: task.system_prompt (if any), then the user message."""
    system = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
    return system + [{"role": "user", "content": user_text(task, question)}]


def task_template(task: TaskConfig) -> ChatTemplate:
    """The template of task.tokenizer_dir, which task.chat_template needs."""
    check(bool(task.tokenizer_dir), "task.chat_template",
          "renders the checkpoint's template, so it needs task.tokenizer_dir (the "
          "directory with tokenizer_config.json; `experiments.quickstart --hf DIR` sets "
          "it); set it or task.chat_template=false")
    return ChatTemplate.from_dir(task.tokenizer_dir)


def prompt_renderer(task: TaskConfig) -> Callable[[str], str]:
    """question -> final prompt text (module docstring). The template is loaded and
    rendered once here, so a broken one fails when the data loads."""
    if not task.chat_template:
        return lambda question: user_text(task, question)
    template = task_template(task)

    def render(question: str) -> str:
        return template.render(prompt_messages(task, question),
                               add_generation_prompt=task.add_generation_prompt,
                               enable_thinking=task.enable_thinking)

    render("1 + 1 = ?")
    return render

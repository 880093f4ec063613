"""Prompts rendered with the checkpoint's own jinja chat template (Qwen3-style fixture
from tests/hf_fixtures.py): the same ids as transformers' apply_chat_template, special
tokens encoded as single ids, the task's wording, and clear errors at load."""
import json

import pytest
from hf_fixtures import QWEN3_CHAT_TEMPLATE, write_qwen_tokenizer

from stablerl_jax.config import ConfigError, TaskConfig
from stablerl_jax.data.chat_template import ChatTemplate, ChatTemplateError, prompt_renderer
from stablerl_jax.data.hf_tokenizer import HFTokenizer

BOXED = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."
QUESTION = "What is 12 + 7?"


@pytest.fixture
def qwen_dir(tmp_path):
    write_qwen_tokenizer(tmp_path)
    return tmp_path


def _task(path, **kw):
    return TaskConfig(kind="jsonl", jsonl_dir="unused", tokenizer_dir=str(path),
                      chat_template=True, **kw)


@pytest.mark.interop
@pytest.mark.parametrize("system", ["", "You are a helpful assistant."])
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_ids_equal_transformers_apply_chat_template(qwen_dir, system, thinking,
                                                     generation_prompt):
    transformers = pytest.importorskip("transformers")
    task = _task(qwen_dir, system_prompt=system, prompt_template=BOXED,
                 enable_thinking=thinking, add_generation_prompt=generation_prompt)
    ours = HFTokenizer.from_dir(str(qwen_dir)).encode(prompt_renderer(task)(QUESTION))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": BOXED.replace("{question}", QUESTION)}]
    hf = transformers.AutoTokenizer.from_pretrained(str(qwen_dir))
    want = hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                  add_generation_prompt=generation_prompt,
                                  enable_thinking=thinking)
    assert ours == list(want)


def test_rendered_prompt_and_its_special_ids(qwen_dir):
    raw = write_qwen_tokenizer(qwen_dir)
    tok = HFTokenizer.from_dir(str(qwen_dir))
    render = prompt_renderer(_task(qwen_dir, system_prompt="Be brief.",
                                   prompt_template=BOXED, enable_thinking=False))
    text = render(QUESTION)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                    f"{QUESTION}\nPlease reason step by step, and put your final answer "
                    "within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
                    "<think>\n\n</think>\n\n")
    ids = tok.encode(text)
    start, end = raw.token_to_id("<|im_start|>"), raw.token_to_id("<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2 and ids[0] == start
    assert raw.token_to_id("<think>") in ids and raw.token_to_id("</think>") in ids
    # <think> tags are added but not special (as in Qwen3): decoding keeps them, so the
    # reward can find the think block; the chat markers are dropped.
    assert tok.decode(tok.encode("<think>a</think>b<|im_end|>")) == "<think>a</think>b"
    thinking = prompt_renderer(_task(qwen_dir))(QUESTION)
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking


def test_without_a_chat_template_only_the_wording_applies():
    render = prompt_renderer(TaskConfig(prompt_template=BOXED))
    assert render("1 + 2 = ?") == ("1 + 2 = ?\nPlease reason step by step, and put your "
                                   "final answer within \\boxed{}.")
    assert prompt_renderer(TaskConfig())("q") == "q"


def test_chat_template_jinja_file_wins(qwen_dir):
    (qwen_dir / "chat_template.jinja").write_text("[{{ messages[-1].content }}]")
    assert prompt_renderer(_task(qwen_dir))("q") == "[q]"
    assert ChatTemplate.from_dir(str(qwen_dir)).origin.endswith("chat_template.jinja")


@pytest.mark.parametrize("template, needle", [
    ("{% if %}", "does not compile"),
    ("{{ raise_exception('System role not supported') }}", "System role not supported"),
    ("{{ messages[0].content.nope() }}", "failed to render"),
])
def test_a_broken_template_fails_at_load_naming_the_file(qwen_dir, template, needle):
    cfg_file = qwen_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**cfg, "chat_template": template}))
    with pytest.raises(ChatTemplateError) as e:
        prompt_renderer(_task(qwen_dir))
    assert needle in str(e.value) and str(cfg_file) in str(e.value)
    assert "task.chat_template=false" in str(e.value)


def test_a_missing_template_and_config_errors(tmp_path):
    write_qwen_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        prompt_renderer(_task(tmp_path))
    with pytest.raises(ConfigError, match="chat_template.*task.tokenizer_dir"):
        prompt_renderer(TaskConfig(chat_template=True))
    with pytest.raises(ConfigError, match="system_prompt.*chat_template=true"):
        TaskConfig(system_prompt="Be brief.")
    with pytest.raises(ConfigError, match=r"prompt_template.*\{question\}"):
        TaskConfig(prompt_template="Solve it.")


def test_template_list_takes_default(qwen_dir):
    cfg_file = qwen_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"},
                            {"name": "default", "template": QWEN3_CHAT_TEMPLATE}]
    cfg_file.write_text(json.dumps(cfg))
    assert prompt_renderer(_task(qwen_dir))("q").startswith("<|im_start|>user\nq")

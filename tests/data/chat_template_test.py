"""Prompts rendered with the checkpoint's own jinja chat template (Qwen3-style fixture
from tests/hf_fixtures.py): the same ids as transformers' apply_chat_template, special
tokens encoded as single ids, the task's wording, and clear errors at load; the bounds
on a render (time, sizes) end a hostile template with a one-line error and leave every
other template rendering as transformers renders it."""
import concurrent.futures
import json
import time

import pytest
from hf_fixtures import QWEN3_CHAT_TEMPLATE, write_qwen_tokenizer

from stablerl_jax.config import ConfigError, TaskConfig
from stablerl_jax.data.chat_template import ChatTemplate, ChatTemplateError, prompt_renderer
from stablerl_jax.data.hf_tokenizer import HFTokenizer
from stablerl_jax.data.template_sandbox import RenderLimits

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
    transformers = pytest.importorskip(
        "transformers", reason="the interop extra (transformers) is not installed")
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


# Templates exercising what jinja compiles specially (loops with `loop`, recursive loops,
# macros, call and filter blocks, autoescape, namespaces, `~`, the intercepted operators,
# the checked str methods and filters): the bounded environment must render each exactly
# as the environment transformers builds.
PARITY_TEMPLATES = [
    QWEN3_CHAT_TEMPLATE,
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ loop.cycle('a', 'b') }}"
    "{% if loop.last %}L{% endif %}{{ loop.changed(m.role) }}{% else %}E{% endfor %}"
    "{% for m in [] %}x{% else %}E{% endfor %}",
    "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"
    "{% for k, v in messages[0]|dictsort %}{{ k }}={{ v }};{% endfor %}",
    "{% for x in [[1, [2]], [3]] recursive %}[{% if x is iterable %}{{ loop(x) }}"
    "{% else %}{{ x }}{% endif %}]{% endfor %}",
    "{% macro f(a, b='q') %}<{{ a ~ b }}{{ caller() if caller else '' }}>{% endmacro %}"
    "{{ f(1) }}{% call f(2) %}C{% endcall %}{% generation %}G{% endgeneration %}",
    "{% filter upper %}{{ messages[0].content }} x{% endfilter %}"
    "{% set s %}B{{ 1 + 2 }}{% endset %}{{ s * 2 }}",
    "{% autoescape true %}{{ '<a>' ~ messages[0].content }}{{ '<b>'|safe ~ '<c>' }}"
    "{% endautoescape %}{{ '<d>' }}",
    "{% set ns = namespace(n=0, s='') %}{% for i in range(5) %}{% set ns.n = ns.n + i %}"
    "{% set ns.s = ns.s ~ i %}{% if i == 3 %}{% break %}{% endif %}{% endfor %}"
    "{{ ns.n }}{{ ns.s }}",
    "{{ messages|tojson }}{{ messages|tojson(indent=2) }}{{ [1, 2, 3]|sum }}"
    "{{ [1.5, 2]|sum(start=1) }}{{ [[1], [2]]|sum(start=[]) }}",
    "{{ '%s-%d' % ('a', 3) }}{{ '{}:{:>5}'.format('a', 'b') }}{{ '%(x)s'|format(x=1) }}"
    "{{ 'x'|center(9) }}|{{ 'a\nb'|indent(2, first=true) }}",
    "{{ ['a', 'b']|join(', ') }}{{ messages|map(attribute='role')|join('/') }}"
    "{{ 'abc'|replace('b', 'XX') }}{{ 'aa bb cc'|wordwrap(3) }}",
    "{{ 2 ** 10 }}{{ 3 * 4 }}{{ 'ab' * 3 }}{{ [1] * 3 }}{{ 7 % 3 }}{{ [1] + [2] }}"
    "{{ 'a' + 'b' }}{{ 2.5 * 2 }}{{ messages[0].content.split(' ') }}{{ 'x'.ljust(4) }}|"
    "{{ '-'.join(['a', 'b']) }}{{ 'a{}c'.format('b') }}{{ '{x}'.format_map({'x': 1}) }}",
    "{{ range(3)|list }}{{ [1, 2, 3, 4]|batch(3, 0)|list }}{{ 42.55|round(1, 'floor') }}"
    "{{ messages|length }}{{ undefined_name }}{{ (1, 2) }}{{ {'a': 1} }}",
]
CHAT = [{"role": "system", "content": "Be <b>brief</b>."},
        {"role": "user", "content": "What is 12 + 7?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n19"},
        {"role": "user", "content": "And 12 - 7?"}]


def _transformers_environment():
    """The environment transformers renders chat templates in (utils/chat_template_utils.py,
    less its `{% generation %}` tracker, which these templates do not use)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)
    return env


@pytest.mark.parametrize("template", PARITY_TEMPLATES)
def test_the_bounds_leave_rendering_unchanged(template):
    want = _transformers_environment().from_string(
        template.replace("{% generation %}G{% endgeneration %}", "G")).render(
        messages=CHAT, add_generation_prompt=True, tools=None, documents=None)
    assert ChatTemplate(template, {}, "t.jinja").render(CHAT) == want


@pytest.mark.interop
@pytest.mark.parametrize("template", PARITY_TEMPLATES)
def test_the_bounds_leave_rendering_as_transformers_renders(template):
    pytest.importorskip("transformers",
                        reason="the interop extra (transformers) is not installed")
    from transformers.utils.chat_template_utils import _compile_jinja_template

    want = _compile_jinja_template(template).render(
        messages=CHAT, add_generation_prompt=True, tools=None, documents=None)
    assert ChatTemplate(template, {}, "t.jinja").render(CHAT) == want


def _with_template(path, template):
    cfg_file = path / "tokenizer_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()),
                                    "chat_template": template}))
    return cfg_file


def _one_line_error(call, cfg_file, needle):
    with pytest.raises(ChatTemplateError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and str(cfg_file) in msg and needle in msg, msg
    assert "task.chat_template=false" in msg


NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                "{% endfor %}")


@pytest.mark.parametrize("in_thread", [False, True])
def test_a_template_that_never_ends_stops_at_the_time_limit(qwen_dir, in_thread):
    cfg_file = _with_template(qwen_dir, NESTED_LOOPS)
    template = ChatTemplate.from_dir(str(qwen_dir), RenderLimits(seconds=0.5))
    start = time.monotonic()
    if in_thread:  # no signals: the limit holds off the main thread too
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(template.render, [{"role": "user", "content": "q"}]).result
            _one_line_error(call, cfg_file, "time limit of 0.5 s")
    else:
        _one_line_error(lambda: template.render([]), cfg_file, "RenderLimits.seconds")
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("template, needle", [
    ("{{ ('x'*6*10**9)|length }}", "6,000,000,000 characters"),
    ("{% set ns = namespace(s='xy') %}{% for i in range(64) %}"
     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "RenderLimits.chars"),
    ("{% for i in range(10**6) %}x{% endfor %}", "range() of 1,000,000 items"),
    ("{{ [0] * 10**9 }}", "RenderLimits.items"),
    ("{{ 9 ** (9 ** 9) }}", "RenderLimits.int_bits"),
    ("{{ 'x'|center(10**10) }}", "RenderLimits.chars"),
    ("{{ 'x'.ljust(10**10) }}", "RenderLimits.chars"),
    ("{{ '%0999999999d' % 1 }}", "RenderLimits.chars"),
    ("{{ '{:>{}}'.format(1, 10**10) }}", "RenderLimits.chars"),
    ("{{ range(100000)|join('x' * 1000000) }}", "RenderLimits.chars"),
    ("{{ (['x' * 4000000] * 1000)|string }}", "RenderLimits.chars"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "the rendered text"),
    ("{% set s %}{% for i in range(10000) %}{{ 'x' * 1000 }}{% endfor %}{% endset %}",
     "RenderLimits.chars"),
])
def test_a_template_that_grows_without_bound_stops_at_a_size_limit(qwen_dir, template,
                                                                     needle):
    cfg_file = _with_template(qwen_dir, template)
    start = time.monotonic()
    _one_line_error(lambda: prompt_renderer(_task(qwen_dir)), cfg_file, needle)
    assert time.monotonic() - start < 5


def test_a_long_message_from_raise_exception_stays_one_short_line(qwen_dir):
    cfg_file = _with_template(qwen_dir, "{{ raise_exception('bad\\n' * 1000) }}")
    with pytest.raises(ChatTemplateError) as e:
        prompt_renderer(_task(qwen_dir))
    assert str(cfg_file) in str(e.value) and len(str(e.value)) < 600
    assert "\n" not in str(e.value)

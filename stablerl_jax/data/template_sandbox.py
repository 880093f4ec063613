"""The jinja environment a checkpoint's chat template renders in: transformers' settings
(`apply_chat_template`) in jinja's `ImmutableSandboxedEnvironment`, every render bounded
in time and size.

A chat template is code that ships with a checkpoint. Jinja's sandbox refuses unsafe
attributes and calls, but not work: `{% for i in range(10**5) %}{% for j in range(10**5)
%}…` runs for hours and `{{ ('x'*6*10**9)|length }}` allocates 6 GB. Hence `RenderLimits`:

    seconds   one render's wall time (10 s; a chat renders in well under 10 ms), checked at
              every loop iteration, call, filter and output chunk: any thread, no signals
    chars     the rendered text, every string built (2^22 = 4,194,304: 4x jsonl.MAX_LINE_BYTES)
    items     a list or tuple built, and range() (100,000: jinja's own MAX_RANGE)
    int_bits  an integer computed with * or ** (65,536 bits)

Sizes are checked *before* the operation that would exceed them: `*`, `+`, `**` and `%`
(intercepted binary operators), `~`, `{{ … }}`, macro and block bodies, the str methods
and filters that can outgrow their inputs, and the text of any value a filter is given;
every call's and filter's result is checked after. A value's text size is its str()
length, estimated without building it (template_sizes.py). Past a limit:
`RenderLimitError` naming it. A normal template renders exactly as with transformers
(tests/data/chat_template_test.py).

Jinja compiles `{% for x in xs %}` as a plain Python loop, `a ~ b` and `{{ a }}` inline, so
the parsed template is rewritten first: each loop's iterable, `~` operand and `{{ … }}`
expression goes through a filter (`_bounded_iter`, `_bounded_text`) checking clock or size.
"""
from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import inspect
import json
import re
import string
import time
from collections.abc import Mapping

import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

from stablerl_jax.data.template_sizes import FILTER_SIZES, TEXT_FILTERS, str_method_size, text_size


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    """The bounds of one render (module docstring)."""

    seconds: float = 10.0
    chars: int = 1 << 22
    items: int = 100_000
    int_bits: int = 1 << 16


class RenderLimitError(Exception):
    """A render exceeded one of its `RenderLimits`; the message names the limit."""


# The deadline of the render in progress in this thread (None outside a render: jinja
# folds constant expressions when it compiles, and sizes are still checked then). The
# sandbox's hooks (`concat`, binary operators, filters) receive no render state, and a
# context variable keeps concurrent renders of one template apart.
_DEADLINE: contextvars.ContextVar = contextvars.ContextVar("chat_template_deadline",
                                                           default=None)
_PERCENT_SPEC = re.compile(r"%(\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+)?)?")


def _number(digits: str) -> int:
    """A width or precision in a format string (19 or more digits count as 2^62)."""
    return int(digits) if len(digits) < 19 else 1 << 62


def _int_args(args) -> int:
    items = args if isinstance(args, (tuple, list)) else (args,)
    return max((a for a in items if isinstance(a, int)), default=0)


def _bind(func, args, kwargs) -> dict | None:
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None  # the call itself raises the TypeError
    bound.apply_defaults()
    return bound.arguments


class _Rewrite(NodeTransformer):
    """Routes loops, `~` and `{{ … }}` through the bounded filters (module docstring)."""

    @staticmethod
    def _wrap(node, name):
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = self._wrap(node.iter, "_bounded_iter")
        return node

    def visit_Concat(self, node):
        node = self.generic_visit(node)
        node.nodes = [self._wrap(n, "_bounded_text") for n in node.nodes]
        return node

    def visit_Output(self, node):
        node = self.generic_visit(node)
        node.nodes = [n if isinstance(n, nodes.TemplateData) else
                      self._wrap(n, "_bounded_text") for n in node.nodes]
        return node


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}…{% endgeneration %}` (marking the assistant's text
    for `return_assistant_tokens_mask`), rendered as its body, as there."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with `RenderLimits` (module docstring)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, limits: RenderLimits = RenderLimits()):
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_Generation, jinja2.ext.loopcontrols])
        self.limits = limits

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        self.filters["tojson"] = tojson
        self.filters["sum"] = self._sum
        self.filters = {name: self._bounded_filter(name, f)
                        for name, f in self.filters.items()}
        self.filters["_bounded_iter"] = self._bounded_iter
        self.filters["_bounded_text"] = self._bounded_text
        self.globals["raise_exception"] = raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.globals["range"] = self._range
        self.globals["lipsum"] = self._lipsum

    # -- the checks ---------------------------------------------------------------------

    def tick(self) -> None:
        """Raise once the render in progress is past its deadline."""
        deadline = _DEADLINE.get()
        if deadline is not None and time.monotonic() > deadline:
            raise RenderLimitError(f"ran past the time limit of {self.limits.seconds:g} s "
                                   "per render (RenderLimits.seconds)")

    def check_chars(self, n: int, what: str) -> None:
        if n > self.limits.chars:
            raise RenderLimitError(f"builds {what} of ~{n:,} characters > "
                                   f"{self.limits.chars:,} (RenderLimits.chars)")

    def _check_text(self, value, what: str, indent: int = 0) -> None:
        self.check_chars(text_size(value, self.limits.chars, indent), what)

    def _check_items(self, n: int, what: str) -> None:
        if n > self.limits.items:
            raise RenderLimitError(f"builds {what} of {n:,} items > "
                                   f"{self.limits.items:,} (RenderLimits.items)")

    def _check_bits(self, bits: int, what: str) -> None:
        if bits > self.limits.int_bits:
            raise RenderLimitError(f"computes {what} of ~{bits:,} bits > "
                                   f"{self.limits.int_bits:,} (RenderLimits.int_bits)")

    def _check_percent(self, fmt: str, args) -> None:
        """`fmt % args`: format, each argument's text, width and precision (`*`: largest int)."""
        whole = text_size(args, self.limits.chars)
        n = len(fmt) + whole
        for m in _PERCENT_SPEC.finditer(fmt):
            named, width, precision = m.groups()
            n += whole if named else 0
            for g in (width, precision):
                if g:
                    n += _int_args(args) if g == "*" else _number(g)
        self.check_chars(n, "a %-formatted string")

    def _check_format(self, fmt: str, args, kwargs) -> None:
        """`fmt.format(*args, **kwargs)`: each field may be any argument, widened by the
        numbers of its spec (a nested `{}` width takes the largest int argument)."""
        whole = text_size((args, kwargs), self.limits.chars)
        n = len(fmt)
        for _, field, spec, _ in string.Formatter().parse(fmt):
            if field is None:
                continue
            n += whole + sum(_number(d) for d in re.findall(r"\d+", spec or ""))
            if "{" in (spec or ""):
                n += max(_int_args(args), _int_args(tuple(kwargs.values())))
        self.check_chars(n, "a formatted string")

    def _check_result(self, value, what: str) -> None:
        if isinstance(value, str):
            self.check_chars(len(value), what)

    def _ticked(self, iterable):
        for item in iterable:
            self.tick()
            yield item

    def render(self, template, **variables) -> str:
        """`template.render(**variables)` under a deadline, text counted as `generate` runs."""
        token = _DEADLINE.set(time.monotonic() + self.limits.seconds)
        chunks, n = [], 0
        stream = template.generate(**variables)
        try:
            for chunk in stream:
                n += len(chunk)
                self.check_chars(n, "the rendered text")
                self.tick()
                chunks.append(chunk)
        finally:
            stream.close()
            _DEADLINE.reset(token)
        return "".join(chunks)

    # -- the sandbox's hooks -----------------------------------------------------------

    def _parse(self, source, name, filename):
        tree = _Rewrite().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def concat(self, parts) -> str:
        """Macro, block and call bodies, and `Template.render`: their chunks, joined."""
        parts = list(parts)
        self.check_chars(sum(len(p) for p in parts), "a macro or block's text")
        return "".join(parts)

    def call_binop(self, context, operator, left, right):
        if operator in ("*", "+"):
            self._check_sequence_binop(operator, left, right)
        elif operator == "**":
            if (type(left) is int and type(right) is int and abs(left) > 1
                    and right > 0):
                self._check_bits(left.bit_length() * right, "a power")
        elif operator == "%" and isinstance(left, str):
            self._check_percent(left, right)
        return super().call_binop(context, operator, left, right)

    def _check_sequence_binop(self, operator, left, right) -> None:
        seqs = (str, list, tuple)
        if operator == "*":
            if isinstance(left, seqs) and isinstance(right, int):
                n, seq = len(left) * right, left
            elif isinstance(right, seqs) and isinstance(left, int):
                n, seq = len(right) * left, right
            elif isinstance(left, int) and isinstance(right, int):
                self._check_bits(left.bit_length() + right.bit_length(), "a product")
                return
            else:
                return
        elif isinstance(left, seqs) and isinstance(right, seqs):
            n, seq = len(left) + len(right), left
        else:
            return
        if isinstance(seq, str):
            self.check_chars(n, "a string")
        else:
            self._check_items(n, "a list")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's names
        __self.tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name == "join" and args and not isinstance(args[0], (list, tuple)):
                try:
                    args = (list(__self._ticked(args[0])),) + args[1:]
                except TypeError:
                    pass  # not iterable: join raises its own error
            __self.check_chars(str_method_size(owner, name, args, kwargs),
                               f"str.{name}'s result")
        out = super().call(__context, __obj, *args, **kwargs)
        __self._check_result(out, "a call's result")
        return out

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        @functools.wraps(wrapper)
        def checked(*args, **kwargs):
            if is_map:  # format_map(mapping)
                mapping = args[0] if args and isinstance(args[0], Mapping) else {}
                self._check_format(fmt, (), mapping)
            else:
                self._check_format(fmt, args, kwargs)
            return wrapper(*args, **kwargs)

        return checked

    # -- filters and globals -----------------------------------------------------------

    def _bounded_iter(self, iterable):
        return self._ticked(iterable)

    def _bounded_text(self, value):
        self.tick()
        self._check_text(value, "a value's text")
        return value

    def _bounded_filter(self, name, func):
        value_at = 1 if getattr(func, "jinja_pass_arg", None) else 0
        estimate, to_text = FILTER_SIZES.get(name), name in TEXT_FILTERS

        @functools.wraps(func)
        def bounded(*args, **kwargs):
            self.tick()
            if len(args) > value_at:
                value = args[value_at]
                if name in ("join", "sum") and not isinstance(value, (list, tuple, str)):
                    try:
                        value = list(self._ticked(value))
                    except TypeError:
                        pass  # not iterable: the filter raises its own error
                    args = args[:value_at] + (value,) + args[value_at + 1:]
                if to_text:
                    self._check_text(value, f"the text of filter {name!r}'s value")
            if estimate is not None and (bound := _bind(func, args, kwargs)) is not None:
                estimate(self, bound)
            out = func(*args, **kwargs)
            self._check_result(out, f"filter {name!r}'s result")
            return out

        return bounded

    @jinja2.pass_environment
    def _sum(self, environment, iterable, attribute=None, start=0):
        """jinja's `sum` with each addition checked like `+` (a list summed one item at a
        time grows quadratically inside the builtin)."""
        if attribute is not None:
            iterable = map(jinja2.filters.make_attrgetter(environment, attribute), iterable)
        items = list(self._ticked(iterable))
        number = (int, float, complex)
        if isinstance(start, number) and all(isinstance(x, number) for x in items):
            return sum(items, start)
        sum([], start)  # the builtin's refusal of a string start
        total = start
        for x in items:
            self.tick()
            self._check_sequence_binop("+", total, x)
            total = total + x
        return total

    def _range(self, *args):
        rng = range(*args)
        self._check_items(len(rng), "range()")
        return rng

    def _lipsum(self, n=5, html=True, min=20, max=100):  # noqa: A002 - jinja's names
        if isinstance(n, int) and isinstance(max, int):
            self.check_chars(n * (max * 16 + 16), "lipsum()'s text")
        return generate_lorem_ipsum(n, html, min, max)

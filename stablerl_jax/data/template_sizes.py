"""A chat template's text sizes, estimated before the text is built (`text_size`,
`str_method_size`, `FILTER_SIZES`), for template_sandbox.py to check against
`RenderLimits.chars` (and `items`, `int_bits`) before the operation runs.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

from jinja2.utils import Namespace


def text_size(value, limit: int, indent: int = 0) -> int:
    """An upper estimate of len(str(value)), exact for a str, that stops past `limit`.
    Containers are walked, their text never built (10^5 references to one 4M-character
    string are 4·10^11 characters); `indent` adds that many per element and level (json's)."""
    if isinstance(value, str):  # the common case, exact
        return len(value)
    n, stack = 0, [(value, 0)]
    while stack and n <= limit:
        v, depth = stack.pop()
        if isinstance(v, str):
            n += len(v) + 2  # the quotes of an element's repr
        elif isinstance(v, Namespace):  # its repr shows its attributes
            stack.append((object.__getattribute__(v, "_Namespace__attrs"), depth))
        elif isinstance(v, (dict, list, tuple)) or (
                isinstance(v, (Mapping, Collection)) and not isinstance(v, (bytes, range))):
            items = list(v.items()) if isinstance(v, Mapping) else v
            n += 2 + len(items) * (2 + indent * (depth + 1))
            if n <= limit:
                stack.extend((x, depth + 1) for x in items)
        elif isinstance(v, int) and not isinstance(v, bool):
            n += v.bit_length() // 3 + 2
        else:  # floats, bools, None, ranges, Undefined, macros, …: a short repr
            n += 32 + (len(v) if isinstance(v, bytes) else 0)
    return n


def str_method_size(s: str, name: str, args, kwargs) -> int:
    """An upper estimate of the length of `s.<name>(*args, **kwargs)` for the str methods
    that can outgrow `s`; len(s) for the others (their results are checked after)."""
    def arg(i, key, default):
        return args[i] if len(args) > i else kwargs.get(key, default)

    if name in ("center", "ljust", "rjust", "zfill"):
        width = arg(0, "width", 0)
        return max(len(s), width) if isinstance(width, int) else len(s)
    if name == "expandtabs":
        tab = arg(0, "tabsize", 8)
        return len(s) + s.count("\t") * tab if isinstance(tab, int) else len(s)
    if name == "replace":
        old, new, count = arg(0, "old", ""), arg(1, "new", ""), arg(2, "count", -1)
        if not (isinstance(old, str) and isinstance(new, str) and isinstance(count, int)):
            return len(s)
        k = s.count(old) if old else len(s) + 1
        return len(s) + (k if count < 0 else min(k, count)) * max(0, len(new) - len(old))
    if name == "join":
        items = arg(0, "iterable", ())
        if isinstance(items, str):
            return len(items) * (1 + len(s))
        if not isinstance(items, (list, tuple)):
            return 0
        return (sum(len(x) for x in items if isinstance(x, str))
                + max(len(items) - 1, 0) * len(s))
    if name == "translate":
        table = arg(0, "table", None)
        if isinstance(table, Mapping):
            longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
            return len(s) * max(longest, 1)
    return len(s)


def _center(env, a):
    if isinstance(a["width"], int):
        env.check_chars(max(a["width"], 0), "filter 'center''s result")


def _indent(env, a):
    width = a["width"]
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    text = str(a["s"])
    env.check_chars(len(text) + (len(text.splitlines()) + 1) * max(pad, 0),
                    "filter 'indent''s result")


def _format(env, a):
    env._check_percent(str(a["value"]), a["kwargs"] or a["args"])


def _join(env, a):
    items, sep = a["value"], a["d"]
    n = text_size(items, env.limits.chars)
    if isinstance(items, (list, tuple, str)):
        n += len(items) * text_size(sep, env.limits.chars)
    env.check_chars(n, "filter 'join''s result")


def _replace(env, a):
    count = -1 if a["count"] is None else a["count"]
    if isinstance(count, int):
        env.check_chars(str_method_size(str(a["s"]), "replace",
                                        (str(a["old"]), str(a["new"]), count), {}),
                        "filter 'replace''s result")


def _wordwrap(env, a):
    n = text_size(a["s"], env.limits.chars)
    wrap = a["wrapstring"] or "\n"
    width = a["width"] if isinstance(a["width"], int) and a["width"] > 0 else 1
    # A greedy line and the word that did not fit exceed the width: at most 2n/width
    # breaks (each word longer than the width is broken into width-long pieces).
    env.check_chars(n + (2 * n // width + 2) * text_size(wrap, env.limits.chars),
                    "filter 'wordwrap''s result")


def _tojson(env, a):
    indent = a["indent"]
    pad = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    # json's escapes (two characters for a newline, six for another control character)
    # are left to the check of the result: text without them is estimated exactly.
    env.check_chars(text_size(a["x"], env.limits.chars, indent=max(pad, 0) + 1),
                    "filter 'tojson''s result")


def _batch(env, a):
    if a["fill_with"] is not None and isinstance(a["linecount"], int):
        env._check_items(a["linecount"], "filter 'batch''s rows")


def _round(env, a):
    if a["method"] != "common" and isinstance(a["precision"], int):
        env._check_bits(a["precision"] * 10 // 3, "filter 'round''s scale 10**precision")


# Filters that turn their value into text (str() of a container may be far longer than
# the container: a list of 10^5 references to one long string). Other filters are not
# walked: `messages|length` runs once per message in most templates.
TEXT_FILTERS = frozenset({
    "capitalize", "center", "e", "escape", "forceescape", "format", "indent", "join",
    "lower", "pprint", "replace", "safe", "string", "striptags", "title", "tojson", "trim",
    "truncate", "upper", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr"})

# Filters whose result can outgrow their value's text: each checks the estimate from its
# bound arguments before the filter runs.
FILTER_SIZES = {"center": _center, "indent": _indent, "format": _format, "join": _join,
                 "replace": _replace, "wordwrap": _wordwrap, "tojson": _tojson,
                 "batch": _batch, "round": _round}

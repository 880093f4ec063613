"""Final answers: where a response states one, and how a reference answer is read.

A response's answer is looked for only in its *final* text, the part after the last
`</think>`: what a thinking model writes inside its think block is scratch work (a
truncated `<think>… #### 27 … wait` states no answer). A response with a `<think>` that
is never closed has no answer. A response with no think tags is final text as a whole.

In the final text the extractors are tried in this order; the first that finds an answer
wins, and its name is reported (`SOURCES`) so a run can log how its answers were found:

    boxed      the last complete `\\boxed{…}` / `\\fbox{…}` (nested braces balanced), or
               `\\boxed 5`; the MATH / Qwen3 convention
    hash       the text after the last `####` on its line (GSM8K's convention), when
               it is a number or math expression: a line holding a word, such as
               `#### eleventy 5`, states no answer (math-verify would find the 5 in it)
    answer_is  the text after the last "the answer is" or line-leading "Answer:" (any
               case; DAPO-Math asks for the latter) up to the end of its sentence (". "
               or the line's end), `$…$` removed
    none       no answer: reward 0

Reference answers and extracted answers are read by the same `parse_math`: math-verify's
own extraction first, and, when that finds nothing in a LaTeX-looking string such as
`\\dfrac{3}{4}` (math-verify reads bare LaTeX only inside delimiters), the string inside
`$…$`. A value that is undefined (`\\frac{1}{0}` reads as complex infinity) counts as
unreadable: a reference like that would make every reward 0.
"""
from __future__ import annotations

import re

SOURCES = ("boxed", "hash", "answer_is", "none")
_HASH = re.compile(r"####[ \t]*([^\n]*)")
# "the answer is X" or a line "Answer: X" (DAPO-Math's instruction); the answer runs to
# the end of its sentence: a period followed by a space, or the line's end.
_ANSWER_IS = re.compile(r"(?:the\s+(?:final\s+)?answer\s+is\s*:?|^[ \t]*answer[ \t]*:)[ \t]*"
                        r"(\$[^$\n]*\$|[^\n]*?)(?=\.\s|\.?$)", re.IGNORECASE | re.MULTILINE)
_BOX = re.compile(r"\\(?:boxed|fbox)\b")
_LETTERS = re.compile(r"[^\W\d_]+")  # a run of letters, any script
_LATEX_HINT = re.compile(r"[\\^_{}]")
# Longer answers are not answers; the cap also bounds math_verify's sympy work.
MAX_ANSWER_CHARS = 200


def final_text(text: str) -> str | None:
    """The text after the last `</think>` (all of it without one); None when a `<think>`
    comes after the last `</think>` (the response ends inside a think block)."""
    close = text.rfind("</think>")
    if text.rfind("<think>") > close:
        return None
    return text[close + len("</think>"):] if close >= 0 else text


def opens_think(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open think block (templates that start
    the response's `<think>` themselves): its responses are then scored as if they began
    with `<think>`."""
    return prompt.rfind("<think>") > prompt.rfind("</think>")


def _clean(ans: str) -> str | None:
    ans = ans.strip().replace(",", "").rstrip(".").strip()
    return ans or None


def hash_line(text) -> str | None:
    """The text after the last '####' on its line, number or not: stripped, thousands
    commas and a trailing '.' removed; None if there is no such line or it is empty."""
    if not isinstance(text, str):
        return None
    found = _HASH.findall(text)
    return _clean(found[-1]) if found else None


def is_number(ans: str) -> bool:
    """Whether an answer is a number or math expression rather than prose: it holds no
    word (two or more letters in a row, but for a LaTeX command such as `\\frac`) and no
    further '#'. Single letters pass (`x = 5`, `\\pi`): a variable is not prose."""
    if "#" in ans:
        return False
    return all(len(m.group()) < 2 or ans[m.start() - 1:m.start()] == "\\"
               for m in _LETTERS.finditer(ans))


def parse_final_answer(text) -> str | None:
    """`hash_line(text)` when it `is_number`, else None: `#### eleventy 5` states no
    answer (module docstring). Never raises."""
    ans = hash_line(text)
    return ans if ans is not None and is_number(ans) else None


def _brace_end(text: str, start: int) -> int | None:
    """Index just past the `}` matching the `{` at `start`, or None if never closed."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif text[i] == "}" and (i == 0 or text[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{…}` / `\\fbox{…}` (or `\\boxed x`); an
    unclosed last box (a cut response) falls back to the box before it."""
    for m in reversed(list(_BOX.finditer(text))):
        rest = m.end()
        if text[rest:rest + 1] == "{":
            end = _brace_end(text, rest)
            if end is not None:
                return text[rest + 1:end - 1].strip() or None
        elif text[rest:rest + 1] == " ":
            word = re.match(r" +([^\s$]+)", text[rest:])
            if word:
                return word.group(1)
    return None


def _answer_is(text: str) -> str | None:
    found = _ANSWER_IS.findall(text)
    if not found:
        return None
    ans = found[-1].strip()
    return _clean(ans[1:-1] if ans.startswith("$") else ans)


def extract_answer(text) -> tuple[str | None, str]:
    """(answer, source) of a response (module docstring); (None, 'none') if it states
    none. Never raises."""
    if not isinstance(text, str):
        return None, "none"
    final = final_text(text)
    if final is None:
        return None, "none"
    for source, fn in (("boxed", last_boxed), ("hash", parse_final_answer),
                       ("answer_is", _answer_is)):
        ans = fn(final)
        if ans is not None:
            return ans, source
    return None, "none"


def _defined(value) -> bool:
    """False for sympy's undefined values (zoo from a division by 0, nan)."""
    import sympy
    if isinstance(value, sympy.Basic):
        return not value.has(sympy.zoo, sympy.nan)
    return True


def parse_math(text: str, timeout: int | None = None) -> list:
    """math-verify's parse of an answer string (module docstring), [] if unreadable."""
    from math_verify import parse
    if len(text) > MAX_ANSWER_CHARS:
        return []
    parsed = parse(text, parsing_timeout=timeout)
    if not parsed and _LATEX_HINT.search(text):
        parsed = parse(f"${text}$", parsing_timeout=timeout)
    return parsed if parsed and _defined(parsed[0]) else []


def readable_answer(answer: str) -> bool:
    """Whether a reference answer can be verified against (else every reward is 0)."""
    try:
        return bool(parse_math(answer))
    except Exception:  # noqa: BLE001 - any parser failure means unreadable
        return False

"""Final answers: where a response states one, and how a reference answer is read.

Only the final text, after the last `</think>`, is searched: a think block is scratch
work (a truncated `<think>… #### 27 … wait` states no answer). An unclosed `<think>` has
no answer; without think tags the whole response is final text.

Extractors, in order; the first that finds an answer wins, its name (`SOURCES`) logged:

    boxed      last complete `\\boxed{…}` / `\\fbox{…}` (nested braces balanced), or
               `\\boxed 5` (MATH / Qwen3)
    hash       text after the last `####` on its line (GSM8K), if a number or math
               expression: `#### eleventy 5` states none (math-verify would find the 5)
    answer_is  text after the last "the answer is" or line-leading "Answer:" (any case;
               DAPO-Math asks for it) to the sentence's end (". " or line end), `$…$` removed
    none       no answer: reward 0

`parse_math` reads reference and extracted answers alike: math-verify's extraction, then,
if it finds nothing in LaTeX-looking text (`\\dfrac{3}{4}`: math-verify reads bare LaTeX
only inside delimiters), the text wrapped in `$…$`. An undefined value (`\\frac{1}{0}` is
complex infinity) is unreadable: such a reference would make every reward 0.
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
    """Text after the last `</think>` (all of it without one); None inside an open `<think>`."""
    close = text.rfind("</think>")
    if text.rfind("<think>") > close:
        return None
    return text[close + len("</think>"):] if close >= 0 else text


def opens_think(prompt: str) -> bool:
    """Whether a prompt ends inside `<think>`: its responses are scored as if begun with it."""
    return prompt.rfind("<think>") > prompt.rfind("</think>")


def _clean(ans: str) -> str | None:
    ans = ans.strip().replace(",", "").rstrip(".").strip()
    return ans or None


def hash_line(text) -> str | None:
    """Text after the last '####' on its line (any text; commas, a final '.' dropped) or None."""
    if not isinstance(text, str):
        return None
    found = _HASH.findall(text)
    return _clean(found[-1]) if found else None


def is_number(ans: str) -> bool:
    """Whether an answer is math, not prose: no further '#' and no word (2+ letters in a
    row, LaTeX commands such as `\\frac` aside); single letters (`x = 5`, `\\pi`) pass."""
    if "#" in ans:
        return False
    return all(len(m.group()) < 2 or ans[m.start() - 1:m.start()] == "\\"
               for m in _LETTERS.finditer(ans))


def parse_final_answer(text) -> str | None:
    """`hash_line(text)` if it `is_number` (not `#### eleventy 5`), else None. Never raises."""
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
    """Content of the last complete `\\boxed{…}` / `\\fbox{…}` (or `\\boxed x`), or None."""
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
    """(answer, source) of a response (module docstring), else (None, 'none'). Never raises."""
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

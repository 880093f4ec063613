"""JSONL layouts of math data sets, each read as (question, solution, answer) by a pure
function of one parsed JSON object; data/jsonl.py reads the files.

    format         fields read                                  answer
    gsm8k          question, answer ending in a '#### N' line   N (the '####' line)
    math           problem, solution with \\boxed{…} [, answer]  answer if present, else
                                                                the solution's last box
    dapo           prompt: [{role, content}, …] (the last user   reward_model.ground_truth
                   message is the question), reward_model
    aime           problem or question, answer (a plain answer)  answer
    prompt_answer  prompt (a string), answer                    answer
    custom         task.prompt_field, task.answer_field [,      answer_field
                   task.solution_field]

Answers are normalized alike: a '#### N' line gives N (a non-number, '#### eleventy 5',
makes the record malformed), else the last `\\boxed{…}` its content, else the stripped
text; ints (as AIME files hold) become decimal strings. The solution (SFT target) is the
format's, GSM8K's '<<48/2=24>>' calculator annotations removed, else ''. `task.format=auto`
picks the one named format the first record's fields fit (`detect`), else an error.
"""
from __future__ import annotations

import re
from typing import Callable, NamedTuple

from stablerl_jax.data.answers import hash_line, is_number, last_boxed

_CALCULATOR = re.compile(r"<<[^<>\n]*>>")


class Mapping(NamedTuple):
    """How records are read: a format name and, for 'custom', the field names."""

    format: str
    prompt_field: str = ""
    answer_field: str = ""
    solution_field: str = ""


def text(obj: dict, field: str) -> str:
    """obj[field], a string; KeyError / TypeError otherwise."""
    v = obj[field]
    if not isinstance(v, str):
        raise TypeError(f"field '{field}' must be a string, got {type(v).__name__}")
    return v


def _answer(obj: dict, field: str) -> str | None:
    """The normalized answer in obj[field] (a string, or an int as AIME files have)."""
    v = obj[field]
    return normalize_answer(str(v) if type(v) is int else text(obj, field), field)


def hash_answer(text: str, field: str) -> str | None:
    """N of the last '#### N' line, or None; ValueError if N is no number (answers.is_number)."""
    answer = hash_line(text)
    if answer is not None and not is_number(answer):
        raise ValueError(f"'{field}': after its last '####', {answer[:40]!r} is not a "
                         "number (a word is no answer)")
    return answer


def normalize_answer(text: str, field: str = "answer") -> str | None:
    """A reference text's final answer (module docstring) or None; raises as `hash_answer`."""
    if "####" in text:
        return hash_answer(text, field)
    boxed = last_boxed(text) if "\\boxed" in text or "\\fbox" in text else None
    return (boxed if boxed is not None else text.strip()) or None


def _gsm8k(obj, _):
    solution = text(obj, "answer")
    answer = hash_answer(solution, "answer")
    if answer is None:
        raise ValueError("'answer' has no final '#### N' line")
    return text(obj, "question"), _CALCULATOR.sub("", solution), answer


def _math(obj, _):
    solution = text(obj, "solution")
    answer = _answer(obj, "answer") if "answer" in obj else last_boxed(solution)
    if answer is None:
        raise ValueError("'solution' has no \\boxed{…} answer (and there is no 'answer' "
                         "field)")
    return text(obj, "problem"), solution, answer


def _dapo(obj, _):
    chat = obj["prompt"]
    users = [m.get("content") for m in chat if isinstance(m, dict) and m.get("role") == "user"] \
        if isinstance(chat, list) else []
    if not users or not isinstance(users[-1], str):
        raise TypeError("'prompt' must be a chat list holding a user message "
                        "{'role': 'user', 'content': str}")
    rm = obj["reward_model"]
    if not isinstance(rm, dict):
        raise TypeError("'reward_model' must be an object with 'ground_truth'")
    return users[-1], "", _answer(rm, "ground_truth")


def _aime(obj, _):
    question = text(obj, "problem" if "problem" in obj else "question")
    return question, "", _answer(obj, "answer")


def _prompt_answer(obj, _):
    return text(obj, "prompt"), "", _answer(obj, "answer")


def _custom(obj, m: Mapping):
    solution = text(obj, m.solution_field) if m.solution_field else ""
    return text(obj, m.prompt_field), solution, _answer(obj, m.answer_field)


def fits(obj: dict) -> dict[str, bool]:
    """Which named formats a record's fields fit."""
    has = obj.keys().__contains__
    hash_answer = isinstance(obj.get("answer"), str) and "####" in obj["answer"]
    return {
        "gsm8k": has("question") and hash_answer,
        "math": has("problem") and has("solution"),
        "dapo": isinstance(obj.get("prompt"), list) and isinstance(obj.get("reward_model"),
                                                                   dict),
        "aime": has("answer") and not hash_answer and (
            (has("problem") and not has("solution")) or has("question")),
        "prompt_answer": isinstance(obj.get("prompt"), str) and has("answer"),
    }


READERS: dict[str, Callable] = {"gsm8k": _gsm8k, "math": _math, "dapo": _dapo,
                                "aime": _aime, "prompt_answer": _prompt_answer,
                                "custom": _custom}
NAMED = tuple(k for k in READERS if k != "custom")


class NoFormatError(ValueError):
    """No named format, or more than one, fits a record's fields."""


def detect(obj: dict, path: str) -> str:
    """The one named format `obj` fits; else an error naming the file, fields and fix."""
    fitting = [name for name, ok in fits(obj).items() if ok]
    if len(fitting) == 1:
        return fitting[0]
    fields = sorted(obj)
    if not fitting:
        raise NoFormatError(
            f"{path}: no known format fits the fields {fields} (gsm8k: question + answer "
            "with '#### N'; math: problem + solution; dapo: prompt chat list + "
            "reward_model.ground_truth; aime: problem|question + answer; prompt_answer: "
            "prompt + answer); set task.format=custom task.prompt_field=<field> "
            "task.answer_field=<field>")
    raise NoFormatError(f"{path}: the fields {fields} fit several formats {fitting}; name one "
                     "with task.format=<format>")


def read_record(obj, mapping: Mapping) -> tuple[str, str, str]:
    """(question, solution, answer) of a JSON object under `mapping` (not 'auto'), or raises."""
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
    question, solution, answer = READERS[mapping.format](obj, mapping)
    if answer is None:
        raise ValueError("the answer is empty")
    return question, solution, answer

"""GSM8K-style JSONL data from a local directory (never downloaded).

Expected files in `jsonl_dir` (the TFDS manual directory): `train.jsonl` and `test.jsonl`,
one JSON object per line with string fields "question" and "answer", the answer ending in
a line "#### N" (GSM8K's format; MATH-style data converts to it by appending
"#### <final answer>" to the solution). Records get the synthetic task's fields:

    id        "<split>-<line number, zero-padded>"  (sorting ids restores file order)
    prompt    the question
    solution  the answer text with GSM8K's "<<48/2=24>>" calculator annotations removed
    answer    N, the text after the last "####" (thousands commas removed)

A malformed line (invalid UTF-8, bad JSON, missing/non-string field, no "#### N", a
reference answer math-verify cannot read, a line over MAX_LINE_BYTES) is an error naming
the file and line number, unless `skip_malformed` is set: then such lines are skipped and
their number is stored in the dataset's metadata (`skipped_counts`). A split with no
record left is an error naming its file. The builder config name carries a fingerprint of
both files, so editing them triggers a rebuild.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

import tensorflow_datasets as tfds

from stablerl_jax.data.rewards import parse_final_answer

SPLITS = ("train", "test")
_CALCULATOR = re.compile(r"<<[^<>\n]*>>")
MAX_LINE_BYTES = 1 << 20  # one problem; a longer line is a broken file, not a record


def _readable_answer(answer: str) -> bool:
    """Whether math-verify parses the reference answer (else every reward would be 0)."""
    from math_verify import parse
    try:
        return bool(parse(answer, parsing_timeout=None))
    except Exception:  # noqa: BLE001 - any parser failure means unreadable
        return False


class MalformedLineError(ValueError):
    """A JSONL line is not a {"question": str, "answer": "... #### N"} object."""


def parse_jsonl(path: str, skip_malformed: bool = False, split: str | None = None
                ) -> tuple[list[dict], int]:
    """(records of one JSONL file, number of skipped malformed lines)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file; put train.jsonl and test.jsonl "
                                "(fields 'question', 'answer' ending in '#### N') in "
                                "task.jsonl_dir")
    split = split or os.path.splitext(os.path.basename(path))[0]
    records, skipped = [], 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                if len(raw) > MAX_LINE_BYTES:
                    raise ValueError(f"line of {len(raw):,} bytes > MAX_LINE_BYTES "
                                     f"({MAX_LINE_BYTES:,})")
                line = raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
                question, solution = obj["question"], obj["answer"]
                if not isinstance(question, str) or not isinstance(solution, str):
                    raise TypeError("'question' and 'answer' must be strings")
                answer = parse_final_answer(solution)
                if answer is None:
                    raise ValueError("'answer' has no final '#### N' line")
                if not _readable_answer(answer):
                    raise ValueError(f"the final answer {answer[:40]!r} is not a number or "
                                     "expression math-verify can read")
            except (ValueError, KeyError, TypeError) as e:
                if skip_malformed:
                    skipped += 1
                    continue
                why = f"missing field {e}" if isinstance(e, KeyError) else str(e)
                raise MalformedLineError(f"{path}:{lineno}: malformed record ({why}); fix "
                                         "the line or pass skip_malformed=True") from None
            records.append({"id": f"{split}-{lineno:07d}", "prompt": question,
                            "solution": _CALCULATOR.sub("", solution), "answer": answer})
    if not records:
        raise ValueError(f"{path}: no records ({skipped} malformed line(s) skipped); the "
                         f"{split} split needs at least one problem")
    return records, skipped


def fingerprint(jsonl_dir: str) -> str:
    """Short sha256 of train.jsonl and test.jsonl (missing files hash as absent)."""
    h = hashlib.sha256()
    for split in SPLITS:
        path = os.path.join(jsonl_dir, f"{split}.jsonl")
        h.update(split.encode())
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:12]


class JsonlMathConfig(tfds.core.BuilderConfig):
    def __init__(self, jsonl_dir: str, skip_malformed: bool = False):
        name = f"{fingerprint(jsonl_dir)}{'_skip' if skip_malformed else ''}"
        super().__init__(name=name, version="1.0.0", description=f"JSONL from {jsonl_dir}")
        self.skip_malformed = skip_malformed


class JsonlMath(tfds.core.GeneratorBasedBuilder):
    """GSM8K-style JSONL files from the manual dir, written as array_record."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, file_format: str = "array_record", **kwargs):
        # tfds defaults to tfrecord, whose writer needs TensorFlow; array_record does not,
        # so `tfds.data_source(...)` and `tfds.builder(...)` also work without it.
        super().__init__(file_format=file_format, **kwargs)
    MANUAL_DOWNLOAD_INSTRUCTIONS = ("Place train.jsonl and test.jsonl (fields 'question' and "
                                    "'answer' ending in '#### N') in the manual directory.")

    def _info(self):
        text = tfds.features.Text()
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {"id": text, "prompt": text, "solution": text, "answer": text}),
            metadata=tfds.core.MetadataDict())

    def _split_generators(self, dl_manager):
        return {s: self._generate_examples(os.path.join(dl_manager.manual_dir, f"{s}.jsonl"),
                                           s) for s in SPLITS}

    def _generate_examples(self, path, split):
        records, skipped = parse_jsonl(path, self.builder_config.skip_malformed, split)
        counts = dict(self.info.metadata.get("skipped_counts", {}))
        self.info.metadata["skipped_counts"] = {**counts, split: skipped}
        for rec in records:
            yield rec["id"], rec


def builder(jsonl_dir: str, data_dir: str, skip_malformed: bool = False) -> JsonlMath:
    """The prepared builder (built on first use) for the JSONL files in `jsonl_dir`."""
    for split in SPLITS:
        path = os.path.join(jsonl_dir, f"{split}.jsonl")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file; task.jsonl_dir must name a "
                                    "directory holding train.jsonl and test.jsonl")
    b = JsonlMath(config=JsonlMathConfig(jsonl_dir, skip_malformed), data_dir=data_dir,
                  file_format="array_record")
    tfds.disable_progress_bar()
    b.download_and_prepare(download_config=tfds.download.DownloadConfig(
        manual_dir=os.path.abspath(jsonl_dir)))
    return b


def skipped_counts(jsonl_dir: str, data_dir: str, skip_malformed: bool = True) -> dict:
    """{split: malformed lines skipped when the dataset was built}."""
    return dict(builder(jsonl_dir, data_dir, skip_malformed).info.metadata["skipped_counts"])

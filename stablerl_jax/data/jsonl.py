"""Math problems from local JSONL files (never downloaded), as a TFDS array_record
dataset.

`task.jsonl_dir` names either a directory holding `train.jsonl` and/or `test.jsonl`
(the TFDS manual directory), or one `.jsonl` file, read as the test split (an eval-only
set). One JSON object per line, in any layout of data/formats.py (GSM8K, MATH, DAPO-Math,
AIME, prompt/answer, or custom fields), detected from the first record unless
`task.format` names it. Records get the synthetic task's fields:

    id        "<split>-<line number, zero-padded>"  (sorting ids restores file order)
    prompt    the question (the chat template is applied later, by data/task.py)
    solution  the worked solution where the format has one, else ''
    answer    the normalized final answer (formats.normalize_answer)

A UTF-8 byte-order mark at the start of a file is ignored. A malformed line (invalid
UTF-8, bad JSON, JSON nested deeper than Python's recursion limit, a record the format
cannot read, a reference answer math-verify cannot read or that is undefined like
`\\frac{1}{0}`, a line over MAX_LINE_BYTES) is an error naming the file and line number,
unless `skip_malformed` is set: then such lines are skipped and counted in the dataset's
metadata (`skipped_counts`), next to the format each split was read as (`formats`). A
split with no record left is an error naming its file and the count. The builder config
name carries a fingerprint of the files and the field mapping, so editing either
triggers a rebuild.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import NamedTuple

import tensorflow_datasets as tfds

from stablerl_jax.data import formats
from stablerl_jax.data.answers import readable_answer
from stablerl_jax.data.formats import Mapping

SPLITS = ("train", "test")
MAX_LINE_BYTES = 1 << 20  # one problem; a longer line is a broken file, not a record
_BOM = b"\xef\xbb\xbf"


class MalformedLineError(ValueError):
    """A JSONL line is not a record of the file's format."""


class Parsed(NamedTuple):
    records: list[dict]
    skipped: int      # malformed lines skipped (skip_malformed)
    format: str       # the format the file was read as


def split_files(jsonl_path: str) -> dict[str, str]:
    """{split: file} of a task.jsonl_dir: the directory's train.jsonl / test.jsonl that
    exist, or {'test': path} for a single file; an error when there is neither."""
    if os.path.isfile(jsonl_path):
        return {"test": jsonl_path}
    files = {s: os.path.join(jsonl_path, f"{s}.jsonl") for s in SPLITS}
    files = {s: p for s, p in files.items() if os.path.isfile(p)}
    if not files:
        raise FileNotFoundError(f"{jsonl_path}: no train.jsonl or test.jsonl there; "
                                "task.jsonl_dir must name a directory holding them, or "
                                "one .jsonl file (an eval-only test split)")
    return files


def load_object(raw: bytes) -> dict:
    """One line's JSON object; ValueError / TypeError on a line that is not one (nesting
    deeper than Python's recursion limit included: no record is that deep)."""
    if len(raw) > MAX_LINE_BYTES:
        raise ValueError(f"line of {len(raw):,} bytes > MAX_LINE_BYTES ({MAX_LINE_BYTES:,})")
    try:
        obj = json.loads(raw.decode("utf-8"))  # UnicodeDecodeError is a ValueError
    except RecursionError:
        raise ValueError("JSON nested deeper than the reader follows (Python's recursion "
                         f"limit, {sys.getrecursionlimit()} levels)") from None
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _record(raw: bytes, path: str, lineno: int, mapping: Mapping) -> tuple[dict, str]:
    """(record fields, format name) of one line; raises on a malformed one."""
    obj = load_object(raw)
    name = mapping.format
    if name == "auto":
        name = formats.detect(obj, f"{path}:{lineno}")
    question, solution, answer = formats.read_record(obj, mapping._replace(format=name))
    if not readable_answer(answer):
        raise ValueError(f"the final answer {answer[:40]!r} is not a number or "
                         "expression math-verify can read (or is undefined)")
    return {"prompt": question, "solution": solution, "answer": answer}, name


def parse_jsonl(path: str, skip_malformed: bool = False, split: str | None = None,
                mapping: Mapping = Mapping("auto"), record=_record,
                needs: str = "problem whose answer math-verify can read",
                format_field: str = "task.format") -> Parsed:
    """The records of one JSONL file (module docstring). With format 'auto' the first
    readable record fixes the format for the whole file. `record(raw line, path, line
    number, mapping) -> (fields, format)` reads one line (another layout than the math
    formats: data/sft_data.py); `needs` says what an empty file lacks, `format_field`
    which setting names the format."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file; put train.jsonl and/or test.jsonl "
                                "in task.jsonl_dir, or name one .jsonl file")
    split = split or os.path.splitext(os.path.basename(path))[0]
    records, skipped, chosen = [], 0, None
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            if not raw.strip():
                continue
            try:
                rec, name = record(raw, path, lineno, mapping._replace(
                    format=chosen or mapping.format))
            except formats.NoFormatError as e:
                if skip_malformed:
                    skipped += 1
                    continue
                raise MalformedLineError(str(e)) from None
            except (ValueError, KeyError, TypeError) as e:
                if skip_malformed:
                    skipped += 1
                    continue
                why = f"missing field {e}" if isinstance(e, KeyError) else str(e)
                fmt = chosen or mapping.format
                raise MalformedLineError(
                    f"{path}:{lineno}: malformed record of format {fmt!r} ({why}); fix the "
                    f"line, name the right {format_field}, or pass skip_malformed=True"
                ) from None
            chosen = name
            records.append({"id": f"{split}-{lineno:07d}", **rec})
    if not records:
        raise ValueError(f"{path}: no records ({skipped} malformed line(s) skipped); the "
                         f"{split} split needs at least one {needs}")
    return Parsed(records, skipped, chosen)


def fingerprint(files: dict[str, str], mapping: Mapping) -> str:
    """Short sha256 of the split files' bytes and the field mapping."""
    h = hashlib.sha256(repr(tuple(mapping)).encode())
    for split, path in sorted(files.items()):
        h.update(split.encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


class JsonlMathConfig(tfds.core.BuilderConfig):
    def __init__(self, files: dict[str, str], skip_malformed: bool = False,
                 mapping: Mapping = Mapping("auto")):
        name = f"{fingerprint(files, mapping)}{'_skip' if skip_malformed else ''}"
        super().__init__(name=name, version="1.0.0", description=f"JSONL from {files}")
        self.files, self.skip_malformed, self.mapping = dict(files), skip_malformed, mapping


class JsonlMath(tfds.core.GeneratorBasedBuilder):
    """Math JSONL files (module docstring), written as array_record."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, file_format: str = "array_record", **kwargs):
        # tfds defaults to tfrecord, whose writer needs TensorFlow; array_record does not,
        # so `tfds.data_source(...)` and `tfds.builder(...)` also work without it.
        super().__init__(file_format=file_format, **kwargs)
    MANUAL_DOWNLOAD_INSTRUCTIONS = ("Place train.jsonl and/or test.jsonl (any format of "
                                    "stablerl_jax/data/formats.py) in the manual directory.")

    def _info(self):
        text = tfds.features.Text()
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {"id": text, "prompt": text, "solution": text, "answer": text}),
            metadata=tfds.core.MetadataDict())

    def _split_generators(self, dl_manager):
        return {s: self._generate_examples(p, s)
                for s, p in self.builder_config.files.items()}

    def _generate_examples(self, path, split):
        cfg = self.builder_config
        parsed = parse_jsonl(path, cfg.skip_malformed, split, cfg.mapping)
        meta = self.info.metadata
        meta["skipped_counts"] = {**meta.get("skipped_counts", {}), split: parsed.skipped}
        meta["formats"] = {**meta.get("formats", {}), split: parsed.format}
        for rec in parsed.records:
            yield rec["id"], rec


def builder(jsonl_path: str, data_dir: str, skip_malformed: bool = False,
            mapping: Mapping = Mapping("auto")) -> JsonlMath:
    """The prepared builder (built on first use) for the JSONL data at `jsonl_path`."""
    files = split_files(jsonl_path)
    b = JsonlMath(config=JsonlMathConfig(files, skip_malformed, mapping), data_dir=data_dir,
                  file_format="array_record")
    tfds.disable_progress_bar()
    manual = jsonl_path if os.path.isdir(jsonl_path) else os.path.dirname(jsonl_path)
    b.download_and_prepare(download_config=tfds.download.DownloadConfig(
        manual_dir=os.path.abspath(manual or ".")))
    return b


def skipped_counts(jsonl_path: str, data_dir: str, skip_malformed: bool = True,
                   mapping: Mapping = Mapping("auto")) -> dict:
    """{split: malformed lines skipped when the dataset was built}."""
    return dict(builder(jsonl_path, data_dir, skip_malformed, mapping
                        ).info.metadata["skipped_counts"])

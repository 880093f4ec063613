"""Math problems from local JSONL or parquet files (never downloaded), as a TFDS
array_record dataset.

`task.jsonl_dir` names a directory holding `train.jsonl` and/or `test.jsonl` (or
`train.parquet` / `test.parquet`: the TFDS manual directory), or one data file: an
eval-only test split. `.parquet` files are parquet (data/parquet.py: verl's layout),
others JSONL; `<split>.jsonl` beside `<split>.parquet` is refused (`split_file`), not
merged. Records are in any layout of data/formats.py, detected from the first unless
`task.format` names it, and get the synthetic task's fields:

    id        "<split>-<line or row number, zero-padded>"  (sorting ids restores file order)
    prompt    the question (the chat template is applied later, by data/task.py)
    solution  the worked solution where the format has one, else ''
    answer    the normalized final answer (formats.normalize_answer)

plus `chat` when verl's `prompt` chat holds more than the question (a system message,
earlier turns): that chat as JSON, which data/task.py renders in place of the question.

A malformed line or row (invalid UTF-8, bad JSON, nesting past Python's recursion limit, a
record the format cannot read, a reference answer math-verify cannot read or that is
undefined like `\\frac{1}{0}`, over MAX_LINE_BYTES: never decoded) is an error naming the
file and line (row), unless `skip_malformed`: then it is skipped and counted in the
metadata (`skipped_counts`, beside each split's `formats`). An unreadable parquet file, a
missing column, or a split left empty is an error naming the file either way. A leading
UTF-8 BOM is ignored. The builder config name fingerprints the files, field mapping and
record fields, so editing any rebuilds. Files open through `etils.epath`.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Iterator, NamedTuple

import tensorflow_datasets as tfds
from etils import epath

from stablerl_jax.data import formats, parquet
from stablerl_jax.data.answers import readable_answer
from stablerl_jax.data.chat_template import chat_messages
from stablerl_jax.data.formats import Mapping

SPLITS = ("train", "test")
SUFFIXES = (".jsonl", parquet.SUFFIX)  # the files a directory may hold per split
MAX_LINE_BYTES = 1 << 20  # one problem; a longer line (row) is a broken file, not a record
_BOM = b"\xef\xbb\xbf"
# The fields of a built record; part of the fingerprint, so a dataset built with other
# fields is rebuilt rather than read.
FIELDS = ("id", "prompt", "solution", "answer", "chat")


class MalformedLineError(ValueError):
    """A JSONL line (parquet row) is not a record of the file's format."""


class Parsed(NamedTuple):
    records: list[dict]
    skipped: int      # malformed lines skipped (skip_malformed)
    format: str       # the format the file was read as


def split_file(directory: str, split: str, setting: str) -> str | None:
    """`split`'s .jsonl or .parquet in `directory`, or None; both: an error citing `setting`."""
    found = [p for p in (os.path.join(directory, split + ext) for ext in SUFFIXES)
             if epath.Path(p).is_file()]
    if len(found) > 1:
        raise ValueError(f"{setting}: both {found[0]} and {found[1]} hold the {split} "
                         "split, and they are not merged; remove or rename one")
    return found[0] if found else None


def split_files(jsonl_path: str) -> dict[str, str]:
    """{split: file} of a task.jsonl_dir: its train / test files, or {'test': path} (a file)."""
    if epath.Path(jsonl_path).is_file():
        return {"test": jsonl_path}
    files = {s: split_file(jsonl_path, s, "task.jsonl_dir") for s in SPLITS}
    files = {s: p for s, p in files.items() if p}
    if not files:
        raise FileNotFoundError(f"{jsonl_path}: no train.jsonl or test.jsonl there (nor "
                                "train.parquet / test.parquet); task.jsonl_dir must name "
                                "a directory holding them, or one .jsonl or .parquet file "
                                "(an eval-only test split)")
    return files


def load_object(raw: bytes) -> dict:
    """One line's JSON object, else ValueError / TypeError (nesting past recursion too)."""
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


def _object(item) -> dict:
    """A JSONL line's object (bytes: `load_object`) or a parquet row; ValueError if Overlong."""
    if isinstance(item, bytes):
        return load_object(item)
    if isinstance(item, parquet.Overlong):
        raise ValueError(f"row of {item.size:,} bytes > MAX_LINE_BYTES ({MAX_LINE_BYTES:,}; "
                         f"column {item.column!r} holds {item.column_size:,})")
    return item


def _record(obj: dict, where: str, mapping: Mapping) -> tuple[dict, str]:
    """(record fields, format name) of one parsed line or row (`where`); raises if malformed."""
    name = mapping.format
    if name == "auto":
        name = formats.detect(obj, where)
    question, solution, answer = formats.read_record(obj, mapping._replace(format=name))
    if not readable_answer(answer):
        raise ValueError(f"the final answer {answer[:40]!r} is not a number or "
                         "expression math-verify can read (or is undefined)")
    rec = {"prompt": question, "solution": solution, "answer": answer}
    if name == "dapo":
        chat = chat_messages(obj["prompt"], "prompt")
        if chat != [{"role": "user", "content": question}]:  # more than the question
            rec["chat"] = json.dumps(chat, ensure_ascii=False)
    return rec, name


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of the non-blank lines of a JSONL file, its BOM dropped."""
    with epath.Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            if raw.strip():
                yield lineno, raw


def parse_jsonl(path: str, skip_malformed: bool = False, split: str | None = None,
                mapping: Mapping = Mapping("auto"), record=_record,
                needs: str = "problem whose answer math-verify can read",
                format_field: str = "task.format") -> Parsed:
    """The records of one data file, JSONL or parquet by name (module docstring); under
    'auto' the first readable record fixes the format. `needs`: what an empty file lacks;
    `record(object, where, mapping) -> (fields, format)` reads one line or row (other
    layouts: data/sft_data.py); `format_field`: the setting that names the format."""
    if not epath.Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file; put train.jsonl and/or test.jsonl "
                                "(or .parquet) in task.jsonl_dir, or name one data file")
    split = split or os.path.splitext(os.path.basename(path))[0]
    if parquet.is_parquet(path):
        items = parquet.rows(path, MAX_LINE_BYTES)
        unit, where = "row", lambda n: f"{path} row {n}"
    else:
        items, unit, where = _lines(path), "line", lambda n: f"{path}:{n}"
    records, skipped, chosen = [], 0, None
    for n, item in items:
        fmt = chosen or mapping.format
        try:
            obj = _object(item)
            rec, name = record(obj, where(n), mapping._replace(format=fmt))
        except parquet.MissingColumn as e:  # the whole file's: never skipped
            fix = ("set task.prompt_field / task.answer_field / task.solution_field to "
                   "columns it has") if fmt == "custom" else (
                   f"name the format that fits with {format_field} (or 'auto')")
            raise parquet.missing_column(path, e, fmt, fix) from None
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
            raise MalformedLineError(
                f"{where(n)}: malformed record of format {fmt!r} ({why}); fix the "
                f"record, name the right {format_field}, or pass skip_malformed=True"
            ) from None
        chosen = name
        records.append({"id": f"{split}-{n:07d}", **rec})
    if not records:
        raise ValueError(f"{path}: no records ({skipped} malformed {unit}(s) skipped); the "
                         f"{split} split needs at least one {needs}")
    return Parsed(records, skipped, chosen)


def fingerprint(files: dict[str, str], mapping: Mapping) -> str:
    """Short sha256 of the split files' bytes, the field mapping and the record fields."""
    h = hashlib.sha256(repr((tuple(mapping), FIELDS)).encode())
    for split, path in sorted(files.items()):
        h.update(split.encode())
        with epath.Path(path).open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:12]


class JsonlMathConfig(tfds.core.BuilderConfig):
    def __init__(self, files: dict[str, str], skip_malformed: bool = False,
                 mapping: Mapping = Mapping("auto")):
        name = f"{fingerprint(files, mapping)}{'_skip' if skip_malformed else ''}"
        super().__init__(name=name, version="1.0.0", description=f"math data from {files}")
        self.files, self.skip_malformed, self.mapping = dict(files), skip_malformed, mapping


class JsonlMath(tfds.core.GeneratorBasedBuilder):
    """Math JSONL or parquet files (module docstring), written as array_record."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, file_format: str = "array_record", **kwargs):
        # tfds defaults to tfrecord, whose writer needs TensorFlow; array_record does not,
        # so `tfds.data_source(...)` and `tfds.builder(...)` also work without it.
        super().__init__(file_format=file_format, **kwargs)
    MANUAL_DOWNLOAD_INSTRUCTIONS = ("Place train.jsonl and/or test.jsonl, or train.parquet "
                                    "and/or test.parquet (any format of "
                                    "stablerl_jax/data/formats.py) in the manual directory.")

    def _info(self):
        text = tfds.features.Text()
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({k: text for k in FIELDS}),
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
            yield rec["id"], {"chat": "", **rec}  # '' = no chat: read_source drops it


def builder(jsonl_path: str, data_dir: str, skip_malformed: bool = False,
            mapping: Mapping = Mapping("auto")) -> JsonlMath:
    """The prepared builder (built on first use) for the data at `jsonl_path`."""
    files = split_files(jsonl_path)
    b = JsonlMath(config=JsonlMathConfig(files, skip_malformed, mapping), data_dir=data_dir,
                  file_format="array_record")
    tfds.disable_progress_bar()
    manual = jsonl_path if epath.Path(jsonl_path).is_dir() else os.path.dirname(jsonl_path)
    # A URI (gs://…) is already absolute; abspath would prefix the working directory.
    manual = manual if "://" in manual else os.path.abspath(manual or ".")
    b.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual))
    return b


def skipped_counts(jsonl_path: str, data_dir: str, skip_malformed: bool = True,
                   mapping: Mapping = Mapping("auto")) -> dict:
    """{split: malformed records skipped when the dataset was built}."""
    return dict(builder(jsonl_path, data_dir, skip_malformed, mapping
                        ).info.metadata["skipped_counts"])

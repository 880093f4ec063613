"""Parquet data files, as verl publishes its data sets (DAPO-Math-17k, AIME 2024/2025),
read row by row into the dicts a JSONL line of the same record parses to.

A `.parquet` name means parquet (data/jsonl.py dispatches on it), read with pyarrow through
`etils.epath`. A row becomes a dict as `pyarrow.Table.to_pylist` makes it (a struct such
as verl's `reward_model` or `extra_info` a dict, its chat `prompt` a list of dicts, an
int64 an int, a null None). Every row has every column, so a missing column the format
reads is the file's fault: `Row` raises `MissingColumn`, which the reader turns into one
error naming the file, its columns and what the format reads (`missing_column`), never
skipped under `skip_malformed`. An unreadable file is one line naming it (`ParquetError`).
A cell Python cannot hold (a date or timestamp past year 9999) becomes an `Unreadable`: a
format reading it finds no string, so the row is malformed (named, or skipped likewise).

A row whose values exceed the byte limit (`rows(path, max_row_bytes)`; data/jsonl.py
passes MAX_LINE_BYTES) is never decoded: its size comes from Arrow's lengths and offsets
(`value_bytes`), and it reads as an `Overlong`, treated as an over-long JSONL line. Rows
are read and decoded BATCH_ROWS at a time.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from etils import epath

SUFFIX = ".parquet"
# Rows read and decoded at a time: a large file is never whole in Python objects, and a
# batch of rows within the limit holds at most BATCH_ROWS * max_row_bytes of values.
BATCH_ROWS = 256


class ParquetError(ValueError):
    """A parquet file that cannot be read, or that lacks a column its format reads."""


class MissingColumn(KeyError):
    """A column the format reads is not in the file."""


class Unreadable:
    """A cell Python cannot hold (module docstring); says why in its repr."""

    def __init__(self, why: str):
        self.why = why

    def __repr__(self) -> str:
        return f"<a value Python cannot hold: {self.why}>"


_CONVERSION = (OverflowError, ValueError, pa.ArrowException)  # what as_py may raise


def _cell(column, i: int):
    try:
        return column[i].as_py()
    except _CONVERSION as e:
        return Unreadable(_brief(e))


def _pylist(batch: pa.RecordBatch) -> list[dict]:
    """The batch's rows as dicts (`to_pylist`), a cell Python cannot hold as `Unreadable`."""
    try:
        return batch.to_pylist()
    except _CONVERSION:
        columns = {}
        for name, column in zip(batch.schema.names, batch.columns):
            try:
                columns[name] = column.to_pylist()
            except _CONVERSION:
                columns[name] = [_cell(column, i) for i in range(len(column))]
        return [dict(zip(columns, values)) for values in zip(*columns.values())]


class Overlong(NamedTuple):
    """A row over the byte limit, left undecoded: its size and its largest column's."""
    size: int
    column: str
    column_size: int


def value_bytes(array: pa.Array) -> np.ndarray:
    """Bytes per value of `array` (int64) from Arrow's lengths and offsets, undecoded: a
    string's or binary's length, a fixed width (bool 1), nested values summed, a null 0."""
    t, n = array.type, len(array)
    if pa.types.is_dictionary(t):
        sizes = value_bytes(array.dictionary)
        indices = array.indices.fill_null(0).to_numpy(zero_copy_only=False)
        out = sizes[indices] if len(sizes) else np.zeros(n, np.int64)
    elif pa.types.is_string_view(t) or pa.types.is_binary_view(t):
        out = value_bytes(array.cast(pa.large_binary()))
    elif (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
          or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)):
        out = pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False)
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        total = np.concatenate(([0], np.cumsum(value_bytes(array.values))))
        offsets = array.offsets.to_numpy()
        out = total[offsets[1:]] - total[offsets[:-1]]
    elif pa.types.is_fixed_size_list(t):  # `values` ignores the array's offset
        k, start = t.list_size, array.offset * t.list_size
        out = value_bytes(array.values)[start:start + n * k].reshape(n, k).sum(axis=1)
    elif pa.types.is_struct(t):  # `field` applies the array's offset
        out = sum((value_bytes(array.field(i)) for i in range(t.num_fields)),
                  np.zeros(n, np.int64))
    elif isinstance(t, pa.BaseExtensionType):
        out = value_bytes(array.storage)
    elif pa.types.is_null(t):
        out = np.zeros(n, np.int64)
    else:
        try:
            out = np.full(n, max(1, t.bit_width // 8), np.int64)
        except ValueError:  # not fixed-width (a union, run-end encoded): each value's slice
            out = np.array([array.slice(i, 1).nbytes for i in range(n)], np.int64)
    out = np.asarray(out, np.int64)
    if array.null_count:
        out = np.where(array.is_valid().to_numpy(zero_copy_only=False), out, 0)
    return out


def _batch_rows(batch: pa.RecordBatch, max_row_bytes: int | None
                ) -> Iterator["Row | Overlong"]:
    """The batch's rows, each a Row or, past `max_row_bytes` (None: no limit), an Overlong."""
    if max_row_bytes is None or not batch.num_columns:
        yield from map(Row, _pylist(batch))
        return
    sizes = np.stack([value_bytes(c) for c in batch.columns])  # (columns, rows)
    totals = sizes.sum(axis=0)
    over = totals > max_row_bytes
    if not over.any():
        yield from map(Row, _pylist(batch))
        return
    kept = iter(_pylist(batch.filter(pa.array(~over))))
    for i in range(batch.num_rows):
        if over[i]:
            j = int(sizes[:, i].argmax())
            yield Overlong(int(totals[i]), batch.schema.names[j], int(sizes[j, i]))
        else:
            yield Row(next(kept))


class Row(dict):
    """A row; a key that is no column raises MissingColumn (in nested structs: KeyError)."""

    def __missing__(self, key):
        raise MissingColumn(key)


def is_parquet(path: str) -> bool:
    return str(path).lower().endswith(SUFFIX)


def _brief(e: Exception) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def rows(path: str, max_row_bytes: int | None = None
         ) -> Iterator[tuple[int, Row | Overlong]]:
    """(row number from 1, Row or Overlong) of every row, in order; else ParquetError."""
    try:
        with epath.Path(path).open("rb") as f:
            n = 0
            for batch in pq.ParquetFile(f).iter_batches(batch_size=BATCH_ROWS):
                for row in _batch_rows(batch, max_row_bytes):
                    n += 1
                    yield n, row
    except (pa.ArrowException, OSError) as e:
        raise ParquetError(f"{path}: not a readable parquet file ({_brief(e)}); write it "
                           "again (pyarrow, pandas.to_parquet, datasets.to_parquet)"
                           ) from None


def columns(path: str) -> list[str]:
    """The file's top-level column names, in order."""
    try:
        with epath.Path(path).open("rb") as f:
            return list(pq.ParquetFile(f).schema_arrow.names)
    except (pa.ArrowException, OSError) as e:
        raise ParquetError(f"{path}: not a readable parquet file ({_brief(e)})") from None


def missing_column(path: str, e: MissingColumn, fmt: str, fix: str) -> ParquetError:
    """The error for a column format `fmt` reads and the file lacks; `fix` names the setting."""
    return ParquetError(
        f"{path}: format {fmt!r} reads the column {e.args[0]!r}, which the file does not "
        f"have (its columns: {columns(path)}); {fix}, or write the file with that column")

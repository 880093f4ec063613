"""Parquet data files, as verl publishes its data sets (DAPO-Math-17k, AIME 2024/2025),
read row by row into the dicts a JSONL line of the same record parses to.

A file is parquet when its name ends in `.parquet` (data/jsonl.py dispatches on that);
it is read with pyarrow through `etils.epath`, so any path epath opens works. A row
becomes a dict as `pyarrow.Table.to_pylist` makes it: a struct column (verl's
`reward_model`, `extra_info`) a dict, a list column (verl's chat `prompt`: a list of
{role, content} structs) a list of dicts, an int64 an int, a null None. Every row has
every column as a key, so a column a format reads but the file lacks is the file's fault,
not a row's: `Row` raises `MissingColumn` for it, and the reader turns that into one
error naming the file, its columns and what the format reads (`missing_column`), which
`skip_malformed` does not skip. A file pyarrow cannot read is one line naming it
(`ParquetError`). A cell pyarrow reads but Python cannot hold (a date or timestamp past
year 9999, which a file may well store) becomes an `Unreadable` value in its row: a
format that reads that field finds no string there, so the row is malformed (named, or
skipped under `skip_malformed`); a column no format reads does not matter.

A row whose values hold more than the reader's byte limit (`rows(path, max_row_bytes)`;
data/jsonl.py passes MAX_LINE_BYTES, its limit on a JSONL line) is never decoded into
Python: its size comes from Arrow's lengths and offsets (`value_bytes`: string and binary
data, each fixed-width value's width, nested values summed), and it is read as an
`Overlong` in its place, which the reader treats as it does an over-long JSONL line.
Rows are read and decoded BATCH_ROWS at a time.
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
    """The batch's rows as dicts (`to_pylist`), a cell Python cannot hold as
    `Unreadable` instead of failing the batch."""
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
    """The bytes each value of `array` holds (int64, one per value), from Arrow's
    lengths and offsets, nothing decoded: a string's or binary's length, a fixed-width
    value's width (a bool 1), the values of a list, map or struct summed, a null 0."""
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
    """The batch's rows in order: each a Row, or an Overlong for a row whose values hold
    more than `max_row_bytes` (not decoded; None: no limit)."""
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
    """One row; a key that is not a column raises MissingColumn (nested structs are
    plain dicts: a field missing there is the row's own KeyError)."""

    def __missing__(self, key):
        raise MissingColumn(key)


def is_parquet(path: str) -> bool:
    return str(path).lower().endswith(SUFFIX)


def _brief(e: Exception) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def rows(path: str, max_row_bytes: int | None = None
         ) -> Iterator[tuple[int, Row | Overlong]]:
    """(row number from 1, row) of every row of the file, in order, a row whose values
    hold more than `max_row_bytes` an Overlong (module docstring); ParquetError when
    pyarrow cannot read it (not parquet, truncated, a corrupt page)."""
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
    """The error for a column that format `fmt` reads and the file lacks; `fix` says
    which setting to change."""
    return ParquetError(
        f"{path}: format {fmt!r} reads the column {e.args[0]!r}, which the file does not "
        f"have (its columns: {columns(path)}); {fix}, or write the file with that column")

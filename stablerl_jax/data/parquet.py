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
"""
from __future__ import annotations

from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from etils import epath

SUFFIX = ".parquet"
BATCH_ROWS = 4096  # rows decoded at a time: a large file is never whole in Python objects


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


class Row(dict):
    """One row; a key that is not a column raises MissingColumn (nested structs are
    plain dicts: a field missing there is the row's own KeyError)."""

    def __missing__(self, key):
        raise MissingColumn(key)


def is_parquet(path: str) -> bool:
    return str(path).lower().endswith(SUFFIX)


def _brief(e: Exception) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def rows(path: str) -> Iterator[tuple[int, Row]]:
    """(row number from 1, row) of every row of the file, in order; ParquetError when
    pyarrow cannot read it (not parquet, truncated, a corrupt page)."""
    try:
        with epath.Path(path).open("rb") as f:
            n = 0
            for batch in pq.ParquetFile(f).iter_batches(batch_size=BATCH_ROWS):
                for row in _pylist(batch):
                    n += 1
                    yield n, Row(row)
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

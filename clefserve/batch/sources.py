"""Batch inputs, read as streams: JSONL (one ``/v1/systemone`` body per line), CSV and Parquet tables.

Every source yields :class:`~clefserve.batch.records.Item` s one at a time and never holds more than one
record (a CSV row, a JSONL line of at most ``--max-body-bytes`` plus its images' allowance, a Parquet
batch of ``PARQUET_BATCH_ROWS`` rows). Positions count from 1: the line number of a JSONL file (blank
lines count as lines but are no records), the row number of a table (the CSV header is not a row).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from clefserve.batch.records import Item, error_from_http, id_error, item_from_json, item_from_row
from clefserve.server.body import parse_json, too_large

FORMATS = ("jsonl", "csv", "parquet")
PARQUET_BATCH_ROWS = 256
_READ_CHUNK = 1 << 20


class InputError(ValueError):
    """The input as a whole cannot be read (missing file, no such column, broken --questions)."""


class Source(Protocol):
    def count(self) -> int | None:
        """How many records the input holds (for the progress bar), or None if unknown."""
        ...

    def __iter__(self) -> Iterator[Item]: ...


def format_of(path: Path, given: str | None) -> str:
    if given is not None:
        return given
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        return "csv"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    return "jsonl"


def require_pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError("Parquet needs pyarrow: pip install 'clefserve[parquet]'") from None
    return pq


class JsonlSource:
    def __init__(self, path: Path, max_bytes: int, text_bytes: int | None = None) -> None:
        """``max_bytes``: the longest line; ``text_bytes``: the longest without its ``images`` (when
        ``max_bytes`` makes room for them)."""
        self.path, self.max_bytes, self.text_bytes = path, max_bytes, text_bytes

    def count(self) -> int:
        n = 0
        with self.path.open("rb") as f:
            for line in f:
                if line.strip():
                    n += 1
        return n

    def __iter__(self) -> Iterator[Item]:
        with self.path.open("rb") as f:
            position = 0
            while True:
                line = f.readline(self.max_bytes + 2)  # bounded: a longer line is refused unread
                if not line:
                    return
                position += 1
                if not line.endswith(b"\n") and len(line) > self.max_bytes:
                    size = len(line) + _skip_line(f)
                    error = item_from_json(line, position, self.max_bytes, self.text_bytes).error
                    yield Item(position, position, error=error, size=size)
                    continue
                raw = line.rstrip(b"\r\n")
                if raw.strip():
                    yield item_from_json(raw, position, self.max_bytes, self.text_bytes)


def _skip_line(f: Any) -> int:
    """Read past the rest of an overlong line without holding it; the number of bytes skipped."""
    skipped = 0
    while True:
        chunk = f.readline(_READ_CHUNK)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


def load_questions(path: Path) -> dict[str, Any]:
    """``--questions FILE.json``: the ``questions`` object of a request, read with the server's JSON rules."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"--questions {path}: {exc.strerror}") from None
    from fastapi import HTTPException

    try:
        value = parse_json(raw)
    except HTTPException as exc:
        raise InputError(f"--questions {path}: {exc.detail[0]['msg']}") from None
    if not isinstance(value, dict):
        raise InputError(f"--questions {path}: expected a JSON object of questions (question id -> question)")
    return value


class _TableSource:
    """Rows to bodies: ``state`` is the one state column's value, or an object of several columns (without
    ``--state-column``: every column but the id column)."""

    def __init__(self, questions: dict[str, Any], model: str, state_columns: list[str] | None,
                 id_column: str | None, max_bytes: int) -> None:
        self.questions, self.model = questions, model
        self.state_columns, self.id_column, self.max_bytes = state_columns, id_column, max_bytes

    def _plan(self, header: list[str]) -> tuple[list[str], str | None]:
        id_column = self.id_column
        if id_column is not None and id_column not in header:
            raise InputError(f"--id-column {id_column!r}: no such column (columns: {', '.join(header)})")
        if id_column is None and "id" in header:
            id_column = "id"
        columns = self.state_columns or [c for c in header if c != id_column]
        missing = [c for c in columns if c not in header]
        if missing:
            raise InputError(f"--state-column {missing[0]!r}: no such column (columns: {', '.join(header)})")
        if not columns:
            raise InputError("no state column: the table has only its id column")
        return columns, id_column

    def _item(self, row: dict[str, Any], position: int, columns: list[str], id_column: str | None) -> Item:
        state = row[columns[0]] if len(columns) == 1 and self.state_columns else {c: row[c] for c in columns}
        record_id = row[id_column] if id_column is not None else None
        return item_from_row(record_id, position, state, self.questions, self.model, self.max_bytes)


class CsvSource(_TableSource):
    def __init__(self, path: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path = path

    def count(self) -> int:
        csv.field_size_limit(max(self.max_bytes + 1, 1 << 17))
        with self.path.open(newline="", encoding="utf-8", errors="replace") as f:
            return max(0, sum(1 for _ in _tolerant_rows(csv.reader(f))) - 1)

    def __iter__(self) -> Iterator[Item]:
        csv.field_size_limit(max(self.max_bytes + 1, 1 << 17))
        with self.path.open(newline="", encoding="utf-8", errors="surrogateescape") as f:
            rows = csv.reader(f)
            header = next(rows, None)
            if header is None:
                return
            columns, id_column = self._plan(header)
            for position, row in enumerate(_tolerant_rows(rows), 1):
                if isinstance(row, csv.Error):
                    yield _too_large_field(position, self.max_bytes, row)
                    continue
                if len(row) != len(header):
                    yield id_error(position, f"row {position} has {len(row)} fields; the header has "
                                             f"{len(header)}")
                    continue
                yield self._item(dict(zip(header, row, strict=True)), position, columns, id_column)


def _tolerant_rows(rows: Iterator[list[str]]) -> Iterator[list[str] | csv.Error]:
    """csv rows; a row the csv module refuses (a field over the size limit) comes out as its error."""
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except csv.Error as exc:
            yield exc
            continue
        yield row


def _too_large_field(position: int, limit: int, exc: csv.Error) -> Item:
    if "larger than field limit" in str(exc):
        return Item(position, position, error=error_from_http(too_large(limit)))
    return id_error(position, f"row {position}: {exc}")


class ParquetSource(_TableSource):
    def __init__(self, path: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path = path
        self._pq = require_pyarrow()

    def count(self) -> int:
        return self._pq.ParquetFile(self.path).metadata.num_rows

    def __iter__(self) -> Iterator[Item]:
        file = self._pq.ParquetFile(self.path)
        columns, id_column = self._plan(file.schema_arrow.names)
        wanted = [*columns, *([id_column] if id_column and id_column not in columns else [])]
        position = 0
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=wanted):
            for row in batch.to_pylist():
                position += 1
                yield self._item(row, position, columns, id_column)


def open_source(
    path: Path, fmt: str, max_bytes: int, questions: dict[str, Any] | None, model: str,
    state_columns: list[str] | None, id_column: str | None, image_bytes: int = 0,
) -> Source:
    """``max_bytes``: --max-body-bytes; ``image_bytes``: what a JSONL line may add for its ``images``
    (table rows carry none)."""
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if fmt == "jsonl":
        if questions is not None or state_columns or id_column:
            raise InputError("--questions, --state-column and --id-column are for CSV and Parquet inputs; "
                             "a JSONL line is a whole /v1/systemone body with an optional id")
        return JsonlSource(path, max_bytes + image_bytes, max_bytes if image_bytes else None)
    if questions is None:
        raise InputError(f"a {fmt.upper()} input needs --questions FILE.json (the questions asked of "
                         "every row)")
    table = CsvSource if fmt == "csv" else ParquetSource
    return table(path, questions, model, state_columns, id_column, max_bytes)

"""OUTPUT: one JSON line per record, appended as records finish, durable, resumable.

Durability: each finished record's line is written (``write(2)``, so it survives the process being
killed, SIGKILL included) in the loop iteration it finishes in, and the file is ``fsync`` ed at least every
``fsync_interval`` seconds while unsynced lines exist, and at exit (so it also survives a machine crash
within that interval plus the time of one fsync). Lines are written whole, each ending in ``\\n``.

Resuming: at start the file is read back; the ids of its lines are what a rerun skips. A last line
without its ``\\n`` (the process died inside a write) is cut off and its record redone; any other line that
is not a JSON object with an ``id`` means the file is not ours, and the batch refuses to append to it.
An exclusive ``flock`` keeps a second batch from appending to the same file at the same time.

Parquet cannot be appended to, so a Parquet OUTPUT is journaled: lines go to ``OUTPUT.journal.jsonl``
exactly as above, and once the input has been read to its end the rows already in OUTPUT and the journal
are written to a new Parquet file that replaces OUTPUT atomically; then the journal is removed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clefserve.batch.idset import IdSet
from clefserve.batch.records import ID_FIELD, id_key

log = logging.getLogger(__name__)

DEFAULT_FSYNC_INTERVAL_S = 0.5
PARQUET_ROWS_PER_GROUP = 4096


class OutputError(RuntimeError):
    """OUTPUT cannot be resumed or written (not ours, locked by another batch, unreadable)."""


def encode_line(obj: dict[str, Any]) -> bytes:
    """Compact JSON like the HTTP responses (non-ASCII kept, no NaN), one line."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode() + b"\n"


def answer_line(record_id: str | int, response: dict[str, Any]) -> bytes:
    return encode_line({ID_FIELD: record_id, **response})


def error_line(record_id: str | int, error: dict[str, Any]) -> bytes:
    return encode_line({ID_FIELD: record_id, "error": error})


def _line_id(line: bytes) -> str | int | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    value = obj.get(ID_FIELD)
    return value if isinstance(value, str | int) and not isinstance(value, bool) else None


class JsonlOutput:
    def __init__(self, path: Path, fsync_interval: float = DEFAULT_FSYNC_INTERVAL_S) -> None:
        self.path, self.fsync_interval = path, fsync_interval
        self.removed_partial = 0  # bytes of a half-written last line cut off at open
        self.lines = 0  # complete lines found at open
        self._fd: int | None = None
        self._unsynced = False
        self._last_sync = time.monotonic()

    def open(self, done: IdSet) -> None:
        """Lock the file, read back the ids already in it into ``done``, cut a half-written last line."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"{self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"{self.path} is being written by another process (a second "
                              "clef-serve batch?)") from None
        try:
            end = self._recover(fd, done)
        except BaseException:
            os.close(fd)
            raise
        os.lseek(fd, end, os.SEEK_SET)
        self._fd = fd

    def _recover(self, fd: int, done: IdSet) -> int:
        good = 0
        with open(fd, "rb", closefd=False) as f:
            for number, line in enumerate(f, 1):
                record_id = _line_id(line) if line.endswith(b"\n") else None
                if record_id is None:
                    if not line.endswith(b"\n"):  # only the last line can lack it
                        self.removed_partial = len(line)
                        break
                    raise OutputError(
                        f"{self.path} line {number} is not a clef-serve batch line (a JSON object with an "
                        "id); refusing to append to it: give another OUTPUT or repair this one")
                done.add(id_key(record_id))
                good += len(line)
                self.lines += 1
        if self.removed_partial:
            os.ftruncate(fd, good)
            os.fsync(fd)
            log.warning("%s ended with a half-written line (%d bytes, the process was killed while writing "
                        "it); it was cut off and its record will be done again", self.path,
                        self.removed_partial)
        return good

    def write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._unsynced = True

    def sync_if_due(self) -> None:
        if self._unsynced and time.monotonic() - self._last_sync >= self.fsync_interval:
            self.sync()

    def sync(self) -> None:
        if self._fd is not None and self._unsynced:
            os.fsync(self._fd)
            self._unsynced = False
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None

    def finish(self) -> None:
        """The input was read to its end (nothing to do for JSONL)."""


PARQUET_COLUMNS = ("id", "status", "response", "error")


def _parquet_schema() -> Any:
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("status", pa.int32()), ("response", pa.string()),
                      ("error", pa.string())])


def parquet_row(line: bytes) -> dict[str, Any]:
    """A journal line as a Parquet row: ``id`` as text, ``status`` (200 or the error's), and the response
    (without the id) or the error as JSON text."""
    obj = json.loads(line)
    record_id = id_key(obj.pop(ID_FIELD))
    error = obj.pop("error", None)
    if error is not None:
        return {"id": record_id, "status": int(error.get("status", 0)), "response": None,
                "error": json.dumps(error, ensure_ascii=False)}
    return {"id": record_id, "status": 200, "response": json.dumps(obj, ensure_ascii=False), "error": None}


class ParquetOutput(JsonlOutput):
    """Columns ``id`` (string), ``status`` (int32: 200, or the error's status), ``response`` and ``error``
    (JSON text, one of them null)."""

    def __init__(self, path: Path, fsync_interval: float = DEFAULT_FSYNC_INTERVAL_S) -> None:
        from clefserve.batch.sources import require_pyarrow

        self._pq = require_pyarrow()
        super().__init__(Path(f"{path}.journal.jsonl"), fsync_interval)
        self.target = path

    def open(self, done: IdSet) -> None:
        if self.target.exists():
            try:
                file = self._pq.ParquetFile(self.target)
                for batch in file.iter_batches(columns=["id"]):
                    for value in batch.column(0).to_pylist():
                        done.add(id_key(value))
                        self.lines += 1
            except Exception as exc:
                raise OutputError(f"{self.target}: not a readable clef-serve batch Parquet file ({exc})") \
                    from None
        super().open(done)

    def finish(self) -> None:
        """Write the rows of OUTPUT (if any) and of the journal to a new Parquet file, replace OUTPUT with
        it atomically, then drop the journal."""
        import pyarrow as pa

        self.sync()
        if self.target.exists() and os.path.getsize(self.path) == 0:  # nothing new
            self.close()
            self.path.unlink()
            return
        schema = _parquet_schema()
        tmp = self.target.with_name(self.target.name + ".tmp")
        with self._pq.ParquetWriter(tmp, schema) as writer:
            if self.target.exists():
                for batch in self._pq.ParquetFile(self.target).iter_batches(columns=list(PARQUET_COLUMNS)):
                    writer.write_batch(batch.cast(schema) if batch.schema != schema else batch)
            for rows in _chunks(self._journal_rows(), PARQUET_ROWS_PER_GROUP):
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.target)
        _fsync_dir(self.target.parent)
        self.close()
        self.path.unlink()

    def _journal_rows(self) -> Iterator[dict[str, Any]]:
        with self.path.open("rb") as f:
            for line in f:
                yield parquet_row(line)


def _chunks(rows: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_output(path: Path, fmt: str, fsync_interval: float) -> JsonlOutput:
    return (ParquetOutput if fmt == "parquet" else JsonlOutput)(path, fsync_interval)

"""The batch loop without a model: OUTPUT recovery, the id set, grouping by state, bounded read-ahead,
and what SIGINT/SIGTERM do to records in flight (a fake backend decides when each record finishes)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from clefserve.batch import idset
from clefserve.batch.feeder import EngineFeeder, answer_all
from clefserve.batch.idset import IdSet
from clefserve.batch.job import BatchJob
from clefserve.batch.lookahead import Lookahead
from clefserve.batch.output import JsonlOutput, OutputError, ParquetOutput, answer_line, error_line
from clefserve.batch.progress import Progress
from clefserve.batch.records import Item, item_from_json
from clefserve.config import EngineConfig
from clefserve.engine import QueueFullError
from clefserve.errors import RequestError

QUESTIONS = {"a": {"type": "noul"}}


def body(state: Any, model: str = "m") -> dict[str, Any]:
    return {"model": model, "state": state, "questions": QUESTIONS}


def record(record_id: str | int, state: Any) -> Item:
    return item_from_json(json.dumps({"id": record_id, **body(state)}).encode(), 1, 10_000)


class FakeBackend:
    """Records what was submitted; answers at once (``instant``) or when the test says so."""

    def __init__(self, instant: bool = True, queue_limit: int | None = None) -> None:
        self.instant, self.queue_limit = instant, queue_limit
        self.submitted: list[dict[str, Any]] = []
        self.futures: list[Future] = []
        self.on_submit: Any = None
        self.config = EngineConfig()

    @staticmethod
    def question_types() -> tuple[str, ...]:
        return ("noul", "choice", "score")

    def submit(self, body: dict[str, Any]) -> Future:
        if body["state"] == "too long":
            raise RequestError("the record has 99 tokens", 413, "tokens_exceeded")
        if self.queue_limit is not None and sum(not f.done() for f in self.futures) >= self.queue_limit:
            raise QueueFullError("busy", 1)
        self.submitted.append(body)
        future: Future = Future()
        self.futures.append(future)
        if self.on_submit is not None:
            self.on_submit(len(self.submitted))
        if self.instant:
            self.answer(future, body)
        return future

    @staticmethod
    def answer(future: Future, body: dict[str, Any]) -> None:
        if future.set_running_or_notify_cancel():
            future.set_result({"model": body["model"], "answers": {"a": {"type": "noul", "noul": 0.5}},
                               "usage": {"input_tokens": 10, "output_tokens": 0, "x_cached_tokens": 4}})


class Signals:
    count = 0
    name: str | None = None

    def send(self, name: str = "SIGTERM") -> None:
        self.count += 1
        self.name = self.name or name


def job_for(items: Iterator[Item], backend: FakeBackend, out: JsonlOutput, window: int = 4,
            lookahead: int = 16, grace_s: float = 30.0) -> BatchJob:
    done = IdSet()
    out.open(done)
    return BatchJob(items, EngineFeeder(backend, window), out, done, Progress(None, quiet=True),
                    Lookahead(lookahead, 1 << 30), grace_s)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


# ---- OUTPUT ----

def test_output_recovery_cuts_a_half_written_last_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(answer_line("a", {"model": "m"}) + error_line(2, {"status": 422}) + b'{"id": "c", "mo')
    out = JsonlOutput(path)
    done = IdSet()
    out.open(done)
    assert ("a" in done, "2" in done, "c" in done) == (True, True, False)
    assert out.removed_partial == len(b'{"id": "c", "mo') and out.lines == 2
    out.write(answer_line("c", {"model": "m"}))
    out.close()
    assert [line["id"] for line in lines(path)] == ["a", 2, "c"]


def test_output_without_the_final_newline_is_also_redone(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(answer_line("a", {}) + answer_line("b", {})[:-1])  # cut right before "\n"
    done = IdSet()
    JsonlOutput(path).open(done)
    assert "a" in done and "b" not in done
    assert path.read_bytes() == answer_line("a", {})


@pytest.mark.parametrize("content", [b"hello\n" + answer_line("a", {}), answer_line("a", {}) + b"[1]\n",
                                     b'{"no_id": 1}\n'])
def test_output_that_is_not_ours_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(content)
    with pytest.raises(OutputError, match="refusing to append"):
        JsonlOutput(path).open(IdSet())
    assert path.read_bytes() == content  # untouched


def test_a_second_writer_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    first = JsonlOutput(path)
    first.open(IdSet())
    with pytest.raises(OutputError, match="another process"):
        JsonlOutput(path).open(IdSet())
    first.close()
    JsonlOutput(path).open(IdSet())


def test_fsync_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    out = JsonlOutput(tmp_path / "out.jsonl", fsync_interval=3600)
    out.open(IdSet())
    out.write(answer_line("a", {}))
    out.sync_if_due()
    assert synced == []  # not due yet: written, not synced
    out.close()
    assert len(synced) == 1  # at exit
    every = JsonlOutput(tmp_path / "out2.jsonl", fsync_interval=0)
    every.open(IdSet())
    for name in "abc":
        every.write(answer_line(name, {}))
        every.sync_if_due()
    assert len(synced) == 4


def test_parquet_output_is_journaled_then_merged(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    target = tmp_path / "out.parquet"
    for names in (["a", "b"], ["c"]):
        out = ParquetOutput(target)
        done = IdSet()
        out.open(done)
        assert all(name not in done for name in names)
        for name in names:
            out.write(answer_line(name, {"model": "m", "answers": {}}))
        out.write(error_line(f"{names[0]}-bad", {"status": 422, "message": "no"}))
        out.finish()
        assert not out.path.exists()  # the journal is gone once merged
    rows = pq.read_table(target).to_pylist()
    assert [r["id"] for r in rows] == ["a", "b", "a-bad", "c", "c-bad"]
    assert rows[0]["status"] == 200 and json.loads(rows[0]["response"]) == {"model": "m", "answers": {}}
    assert rows[2]["status"] == 422 and rows[2]["response"] is None
    assert json.loads(rows[2]["error"]) == {"status": 422, "message": "no"}
    again = IdSet()
    ParquetOutput(target).open(again)
    assert len(again) == 5 and "c-bad" in again


# ---- ids and grouping ----

def test_id_set_across_merges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(idset, "MERGE_EVERY", 7)
    ids = IdSet()
    keys = [f"id-{i}" for i in range(100)]
    assert all(ids.add(k) for k in keys)
    assert len(ids) == 100 and all(k in ids for k in keys)
    assert not any(ids.add(k) for k in keys[::3])
    assert "id-100" not in ids and "5" not in ids
    assert ids.add(str(5)) and "5" in ids  # 5 and "5" are the same id


def test_lookahead_hands_out_records_sharing_a_state_together() -> None:
    ahead = Lookahead(10, 1 << 30)
    states = ["A", {"x": 1, "y": 2}, "A", "C", {"y": 2, "x": 1}, "A", {"x": 1.0, "y": 2}]
    for i, state in enumerate(states):
        ahead.add(record(i, state))
    order = [ahead.pop().id for _ in range(len(states))]
    # key order does not change the encoded state; 1 vs 1.0 does
    assert order == [0, 2, 5, 1, 4, 3, 6]


def test_lookahead_bounds() -> None:
    ahead = Lookahead(3, 1 << 30)
    for i in range(3):
        assert not ahead.full
        ahead.add(record(i, i))
    assert ahead.full
    small = Lookahead(100, 50)
    item = record(0, "x" * 60)
    small.add(item)
    assert small.full
    popped = small.pop()
    small.push_front(popped)
    assert small.pop() is popped and len(small) == 0


# ---- the loop ----

def test_job_writes_every_record_once_and_skips_what_output_has(tmp_path: Path) -> None:
    out_path = tmp_path / "out.jsonl"
    out_path.write_bytes(answer_line("r1", {"model": "earlier"}))
    items = [record(f"r{i}", i % 3) for i in range(20)]
    items.append(item_from_json(b"{bad", 21, 10_000))
    items.append(record("r5", "again"))  # a repeated id
    items.append(record("long", "too long"))
    backend = FakeBackend()
    job = job_for(iter(items), backend, JsonlOutput(out_path))
    result = job.run(Signals())
    job.output.close()
    assert result.completed and result.tally.skipped == 1 and result.tally.duplicates == 1
    written = lines(out_path)
    ids = [line["id"] for line in written]
    assert sorted(map(str, ids)) == sorted(["r1", *(f"r{i}" for i in range(2, 20)), "r0", "21", "long"])
    assert written[0] == {"id": "r1", "model": "earlier"}
    errors = {line["id"]: line["error"] for line in written if "error" in line}
    assert errors[21]["status"] == 422 and errors["long"]["error_type"] == "tokens_exceeded"
    assert result.tally.answered == 19 and result.tally.errors == 2
    assert result.tally.tokens == 190 and result.tally.cached_share() == 0.4


def test_job_reads_ahead_boundedly(tmp_path: Path) -> None:
    """Memory does not grow with the input: read records - written records stays below lookahead +
    window + one read turn, whatever the input's length."""
    read = 0
    gap = 0
    out = JsonlOutput(tmp_path / "out.jsonl")

    def source() -> Iterator[Item]:
        nonlocal read, gap
        for i in range(3000):
            read += 1
            gap = max(gap, read - job.tally.written)
            yield record(i, i % 7)

    job = job_for(source(), FakeBackend(), out, window=4, lookahead=16)
    assert job.run(Signals()).completed and job.tally.written == 3000
    assert gap <= 16 + 4 + 1


def test_submission_groups_states_and_respects_the_window(tmp_path: Path) -> None:
    backend = FakeBackend(instant=False)
    states = [i % 4 for i in range(12)]
    items = [record(i, s) for i, s in enumerate(states)]
    job = job_for(iter(items), backend, JsonlOutput(tmp_path / "out.jsonl"), window=5, lookahead=12)
    in_flight: list[int] = []

    def answer_some(count: int) -> None:
        in_flight.append(sum(1 for f in backend.futures if not f.done()))
        if count % 2 == 0:  # the engine finishes the older half of what it holds
            for future, b in zip(backend.futures, backend.submitted, strict=True):
                if not future.done():
                    FakeBackend.answer(future, b)
                    break

    backend.on_submit = answer_some
    signals = Signals()
    job.feeder.collect = _finishing(job.feeder.collect, backend)  # type: ignore[method-assign]
    assert job.run(signals).completed
    assert max(in_flight) <= 5
    assert [b["state"] for b in backend.submitted] == sorted(states, key=[0, 1, 2, 3].index)


def _finishing(collect: Any, backend: FakeBackend) -> Any:
    """Wraps feeder.collect: before collecting, answer every submitted record (the engine 'runs')."""

    def run(timeout: float) -> Any:
        for future, b in zip(backend.futures, backend.submitted, strict=True):
            if not future.done():
                FakeBackend.answer(future, b)
        return collect(timeout)

    return run


def test_first_signal_finishes_the_records_in_flight(tmp_path: Path) -> None:
    backend = FakeBackend(instant=False)
    signals = Signals()
    out_path = tmp_path / "out.jsonl"
    job = job_for(iter([record(i, i) for i in range(50)]), backend, JsonlOutput(out_path), window=4)

    def after(count: int) -> None:
        if count == 10:
            signals.send("SIGTERM")

    backend.on_submit = after
    job.feeder.collect = _finishing(job.feeder.collect, backend)  # type: ignore[method-assign]
    result = job.run(signals)
    assert not result.completed and result.signal_name == "SIGTERM"
    assert result.tally.abandoned == 0 and result.tally.answered == len(backend.submitted) < 50
    assert len(lines(out_path)) == result.tally.answered


@pytest.mark.parametrize("how", ["second signal", "grace period"])
def test_abandoning_cancels_in_flight_records_and_writes_nothing_for_them(tmp_path: Path, how: str) -> None:
    backend = FakeBackend(instant=False)
    signals = Signals()
    out_path = tmp_path / "out.jsonl"
    job = job_for(iter([record(i, i) for i in range(50)]), backend, JsonlOutput(out_path), window=4,
                  grace_s=0.0 if how == "grace period" else 3600)

    def after(count: int) -> None:
        if count == 2:
            FakeBackend.answer(backend.futures[0], backend.submitted[0])
        if count == 4:
            signals.send("SIGINT")
            if how == "second signal":
                signals.send("SIGINT")

    backend.on_submit = after
    result = job.run(signals)
    assert result.tally.answered == 1 and result.tally.abandoned == 3
    assert result.abandoned_on_timeout == (how == "grace period")
    assert all(f.cancelled() for f in backend.futures[1:])
    assert [line["id"] for line in lines(out_path)] == [0]


def test_answer_all_keeps_the_batch_order() -> None:
    backend = FakeBackend(queue_limit=3)
    backend.instant = False
    items = [record(i, i % 2) for i in range(9)] + [item_from_json(b"[]", 10, 100)]
    feeder = EngineFeeder(backend, window=8)
    feeder.collect = _finishing(feeder.collect, backend)  # type: ignore[method-assign]
    outcomes = answer_all(feeder, items)
    assert [o.item.id for o in outcomes] == [*range(9), 10]
    assert all(o.response for o in outcomes[:9]) and outcomes[9].error["status"] == 422
    assert [b["state"] for b in backend.submitted] == [0] * 5 + [1] * 4

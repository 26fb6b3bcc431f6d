"""One batch run: input records through the engine into OUTPUT, in one loop on the calling thread.

Each turn of the loop reads a few records (skipping ids already in OUTPUT or seen before, writing the
error of a record that cannot be asked), tops the engine up from the lookahead, takes the records that
finished, writes their lines and fsyncs when due. Lines are written in the order records finish, each
carrying its id; the order follows the input except where records sharing a state were pulled forward
(at most ``lookahead`` records) or a short record overtook a long one in the engine.

Signals: the first SIGINT/SIGTERM stops reading and submitting and lets the records in flight finish
(for up to ``grace_s`` seconds); a second one, or the end of the grace period, abandons them (their slots
are freed; they are not written, so a rerun does them).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from clefserve.batch.feeder import EngineFeeder, Outcome
from clefserve.batch.idset import IdSet
from clefserve.batch.lookahead import Lookahead
from clefserve.batch.output import JsonlOutput, answer_line, error_line
from clefserve.batch.progress import Progress, Tally
from clefserve.batch.records import Item
from clefserve.engine import QueueFullError

log = logging.getLogger("clefserve.batch")

READS_PER_TURN = 64
# A turn of the loop reads and encodes for at most about this long, so that finished answers are written
# soon even when records are large (a 1 MiB state takes a noticeable time to parse and tokenize).
TURN_BUDGET_S = 0.1
WAIT_S = 0.05
DEFAULT_LOOKAHEAD = 1024
DEFAULT_LOOKAHEAD_BYTES = 64 << 20
MAX_DUPLICATES_LOGGED = 10


@dataclass
class JobResult:
    tally: Tally
    completed: bool  # the input was read to its end and every record in it was handled
    signal_name: str | None = None
    abandoned_on_timeout: bool = False


class StopSignals:
    """SIGINT/SIGTERM handlers that only count (the loop looks at the count); restored on exit."""

    def __init__(self) -> None:
        self.count = 0
        self.name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.name = self.name or signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class BatchJob:
    def __init__(
        self, records: Iterator[Item], feeder: EngineFeeder, output: JsonlOutput, done: IdSet,
        progress: Progress, lookahead: Lookahead, grace_s: float = 30.0,
    ) -> None:
        """``done``: the ids already in OUTPUT."""
        self.records, self.feeder, self.output, self.done = records, feeder, output, done
        self.progress, self.lookahead, self.grace_s = progress, lookahead, grace_s
        self.seen = IdSet()  # ids of this run's input so far
        self.tally = Tally()
        self._pending: list[bytes] = []

    def run(self, signals: StopSignals) -> JobResult:
        exhausted = False
        stop_at: float | None = None
        on_timeout = False
        while True:
            if signals.count and stop_at is None:
                stop_at = time.monotonic()
                log.warning("%s: reading stopped; finishing the %d records in flight (up to %.0f s; %s "
                            "again to abandon them)", signals.name, self.feeder.in_flight, self.grace_s,
                            signals.name)
            stopping = stop_at is not None
            if stopping and (signals.count > 1 or time.monotonic() - stop_at > self.grace_s):
                on_timeout = signals.count <= 1
                self._take(self.feeder.abandon())
                break
            if not stopping and not exhausted:
                exhausted = self._read()
            if not stopping:
                self._submit()
            idle = exhausted or stopping or self.lookahead.full
            self._take(self.feeder.collect(WAIT_S if idle else 0.0))
            self._flush()
            self.progress.update(self.tally)
            if (exhausted or stopping) and self.feeder.in_flight == 0 and (stopping or not self.lookahead):
                break
        self._flush()
        self.output.sync()
        self.progress.close(self.tally)
        completed = exhausted and not stopping and not self.lookahead
        return JobResult(self.tally, completed, signals.name, on_timeout)

    def _read(self) -> bool:
        """Up to READS_PER_TURN records into the lookahead; True once the input is used up."""
        until = time.monotonic() + TURN_BUDGET_S
        for _ in range(READS_PER_TURN):
            if self.lookahead.full or time.monotonic() > until:
                return False
            item = next(self.records, None)
            if item is None:
                return True
            self._admit(item)
        return False

    def _admit(self, item: Item) -> None:
        key = item.key
        if key in self.done:
            self.tally.skipped += 1
            return
        if not self.seen.add(key):
            self.tally.duplicates += 1
            if self.tally.duplicates <= MAX_DUPLICATES_LOGGED:
                log.warning("id %r at position %d was seen earlier in the input: skipped", item.id,
                            item.position)
            return
        self.feeder.validate(item)
        if item.error is not None:
            self._write(Outcome(item, error=item.error))
        else:
            self.lookahead.add(item)

    def _submit(self) -> None:
        until = time.monotonic() + TURN_BUDGET_S
        while self.lookahead and self.feeder.has_room:
            if self.feeder.in_flight and time.monotonic() > until:
                return
            item = self.lookahead.pop()
            try:
                outcome = self.feeder.submit(item)
            except QueueFullError:
                self.lookahead.push_front(item)
                return
            if outcome is not None:
                self._take([outcome])

    def _take(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            if outcome.abandoned:
                self.tally.abandoned += 1
            elif outcome.failure is not None:
                self.tally.failed += 1
            else:
                self._write(outcome)

    def _write(self, outcome: Outcome) -> None:
        item = outcome.item
        if outcome.response is not None:
            usage = outcome.response.get("usage", {})
            self.tally.answered += 1
            self.tally.tokens += int(usage.get("input_tokens", 0))
            self.tally.cached_tokens += int(usage.get("x_cached_tokens") or 0)
            self._pending.append(answer_line(item.id, outcome.response))
        else:
            assert outcome.error is not None
            self.tally.errors += 1
            self._pending.append(error_line(item.id, outcome.error))

    def _flush(self) -> None:
        if self._pending:
            self.output.write(b"".join(self._pending))
            self._pending.clear()
        self.output.sync_if_due()

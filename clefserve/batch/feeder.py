"""Keeps the engine full: submits records up to a window and hands back each one as it finishes.

Records go through :meth:`EngineBackend.submit`, the HTTP route's own encoding, engine and head, so an
answer is the one ``POST /v1/systemone`` gives for the same body. The window (records submitted and not
yet finished) is a little more than ``--max-num-seqs``, so that a finished sequence's slot is refilled in
the engine's next step from its waiting queue.
"""

from __future__ import annotations

import logging
import queue
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clefserve.batch.records import Item, error_from_request, validate
from clefserve.engine import EngineClosedError, QueueFullError
from clefserve.errors import RequestError
from clefserve.server.limits import RequestLimits

if TYPE_CHECKING:
    from clefserve.formats.clef.engine_backend import EngineBackend

log = logging.getLogger(__name__)

# How long an abandoned record whose answer is being computed right now (the head) may still take.
ABANDON_WAIT_S = 5.0


def window_for(max_num_seqs: int, max_queue: int) -> int:
    """Twice the running sequences, at least 8 more than them, within the engine's queue bound."""
    return max(1, min(max(2 * max_num_seqs, max_num_seqs + 8), max_num_seqs + max_queue))


@dataclass
class Outcome:
    """Exactly one of: ``response`` (the System One body), ``error`` (a 4xx refusal), ``failure`` (an
    unexpected exception: a bug, which the HTTP route would answer 500), ``abandoned`` (stopped early)."""

    item: Item
    response: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    failure: BaseException | None = None
    abandoned: bool = False


class EngineFeeder:
    def __init__(self, backend: EngineBackend, window: int) -> None:
        self.backend, self.window = backend, window
        config = backend.config
        self.limits = RequestLimits(config.max_questions, config.max_choice_labels, config.max_score_levels)
        self._in_flight: dict[Future, Item] = {}
        self._done: queue.SimpleQueue[Future] = queue.SimpleQueue()

    def validate(self, item: Item) -> None:
        """Check ``item`` as the HTTP route would for this engine's flags and model (else ``item.error``)."""
        validate(item, self.limits, self.backend.question_types())

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def has_room(self) -> bool:
        return len(self._in_flight) < self.window

    def submit(self, item: Item) -> Outcome | None:
        """Queue a validated record; an outcome at once when it cannot run. Raises ``QueueFullError`` when
        the engine's queue is full (give the record back and wait for one to finish)."""
        assert item.body is not None
        try:
            future = self.backend.submit(item.body)
        except QueueFullError:
            raise
        except RequestError as exc:  # the record can never run: too long, a schema over --max-length...
            return Outcome(item, error=error_from_request(exc))
        except EngineClosedError:
            return Outcome(item, abandoned=True)
        except Exception as exc:
            log.exception("encoding record %r failed", item.id)
            return Outcome(item, failure=exc)
        self._in_flight[future] = item
        future.add_done_callback(self._done.put)
        return None

    def collect(self, timeout: float) -> list[Outcome]:
        """Every record finished by now, waiting up to ``timeout`` seconds for the first one."""
        if not self._in_flight:
            return []
        futures = []
        try:
            futures.append(self._done.get(timeout=timeout) if timeout > 0 else self._done.get_nowait())
            while True:
                futures.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return [self._outcome(future) for future in futures if future in self._in_flight]

    def _outcome(self, future: Future, timeout: float | None = None) -> Outcome:
        item = self._in_flight.pop(future)
        try:
            return Outcome(item, response=future.result(timeout))
        except TimeoutError:
            return Outcome(item, abandoned=True)
        except RequestError as exc:
            return Outcome(item, error=error_from_request(exc))
        except (EngineClosedError, CancelledError):
            return Outcome(item, abandoned=True)
        except Exception as exc:
            log.error("record %r failed: %s: %s", item.id, type(exc).__name__, exc)
            return Outcome(item, failure=exc)

    def abandon(self) -> list[Outcome]:
        """Cancel every record in flight (its blocks and slot are freed); answers that finished meanwhile,
        or whose head is running right now, are still handed back."""
        for future in list(self._in_flight):
            future.cancel()
        return [self._outcome(future, ABANDON_WAIT_S) for future in list(self._in_flight)]


def answer_all(feeder: EngineFeeder, items: list[Item]) -> list[Outcome]:
    """Every item's outcome, in the order given; the engine sees them grouped by state (the lookahead
    holds them all) and at most ``feeder.window`` at a time. For callers that hold a whole batch in memory
    (``clefserve.ray``); ``clef-serve batch`` streams instead."""
    from clefserve.batch.lookahead import Lookahead

    slot = {id(item): index for index, item in enumerate(items)}
    outcomes: dict[int, Outcome] = {}
    waiting = Lookahead(len(items) + 1, 1 << 62)
    for index, item in enumerate(items):
        feeder.validate(item)
        if item.error is not None:
            outcomes[index] = Outcome(item, error=item.error)
        else:
            waiting.add(item)
    while waiting or feeder.in_flight:
        while waiting and feeder.has_room:
            item = waiting.pop()
            try:
                outcome = feeder.submit(item)
            except QueueFullError:
                waiting.push_front(item)
                break
            if outcome is not None:
                outcomes[slot[id(item)]] = outcome
        for outcome in feeder.collect(0.1):
            outcomes[slot[id(outcome.item)]] = outcome
    return [outcomes[i] for i in range(len(items))]

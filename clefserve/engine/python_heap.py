"""Keep what a server loads at startup out of Python's full garbage collections.

CPython's cyclic collector stops every thread for the length of a collection: it holds the GIL, and the
engine's lanes need the GIL between any two torch ops. A full (generation 2) collection walks every tracked
object, and a loaded server tracks ~175,000-213,000 (torch's, FastAPI's and pydantic's functions, types
and dicts; the weights are a few hundred tensor objects, whatever their size): 60-88 ms on the 2-core
benchmark host.
Request handling allocates enough (the JSON of long records, their encodings) to run one every few bursts,
so a short record that arrived with a burst of long ones waited ~85 ms more, measured in a traced burst on
``clef256``.

None of those objects is garbage: the server keeps them until it exits. ``gc.freeze()`` moves them to the
permanent generation, which collections skip; a full collection then walks only what requests left alive
since (no pass over 2 ms in the traced bursts; 8.7 ms after 96 fresh records had filled the prefix cache).
A frozen object still goes when its last reference does; only one that becomes part of unreachable
reference cycles later is never collected, so the freeze comes once, after loading, and only in processes
that serve until they exit (``serve``, ``batch``; not the tests' engines).

:data:`collector_pauses` records every pass of the collector in the process once installed (the server's
metrics install it): how many per generation, and how long each stopped every thread.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


def freeze_loaded_objects() -> int:
    """Collect once, then freeze every object that survived (call when loading is done); returns how many
    objects are frozen."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("python heap: %d loaded objects frozen out of the garbage collector's passes (%.2f s)",
             frozen, time.perf_counter() - started)
    return frozen


# Upper bounds (seconds) of the pause histogram: a young pass takes well under a millisecond, a full pass of
# an unfrozen server tens of milliseconds.
PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
GENERATIONS = 3


@dataclass
class GenerationPauses:
    count: int = 0
    seconds: float = 0.0
    within: list[int] = field(default_factory=lambda: [0] * len(PAUSE_BUCKETS))  # passes <= each bound


class CollectorPauses:
    """The garbage collector's passes in this process since :meth:`install`, per generation. A pass runs
    under the GIL on whichever thread triggered it, never two at once, so the callback needs no lock."""

    def __init__(self) -> None:
        self.generations = [GenerationPauses() for _ in range(GENERATIONS)]
        self._started = 0.0

    def install(self) -> None:
        """Start recording (idempotent)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._started
        record = self.generations[info["generation"]]
        record.count += 1
        record.seconds += elapsed
        for i, bound in enumerate(PAUSE_BUCKETS):
            if elapsed <= bound:
                record.within[i] += 1

    def totals(self) -> list[tuple[int, float]]:
        """(passes, seconds) per generation."""
        return [(g.count, g.seconds) for g in self.generations]


collector_pauses = CollectorPauses()

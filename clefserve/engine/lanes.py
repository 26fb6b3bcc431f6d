"""CPU lanes: the engine runs up to two steps at once, each on its own worker thread, over disjoint sequences,
and the two share the CPU's intra-op threads.

Why: on a CPU much of a step's time goes to ops too small to keep two threads busy (the delta rule's
per-chunk matmuls, norms, gates, each op's dispatch). On a 2-core Xeon, a hidden-256 release's ~3,000-token
record runs 1.75x faster on two threads than on one, its delta rule only 1.46x; two records side by side on
one thread each are answered ~15-20% sooner than one after the other on two. So while a second step's work
is there, the engine runs it beside the first, each on half the threads; a step that runs alone has them all.

How the threads move (:class:`ThreadShare`): a lane's share is every thread while it alone is busy, else half
(the first lane gets the odd one). A lane that starts a step beside a busy one waits until that one has
narrowed, which it does at its next layer boundary (or between two steps), so the cores are never
oversubscribed: a parallel region one of whose threads is descheduled waits for it. A lane that narrows, or
stops being busy, releases its OpenMP team: a team beyond the CPUs makes libgomp wake every parallel region's
workers through the kernel (:mod:`clefserve.engine.openmp`). A lane whose long step holds for a step of short
records on the other lane leaves the busy set for that time, so the short step widens to every thread
(``Engine._hold_for_short_steps``).
"""

from __future__ import annotations

import threading

import torch

from clefserve.engine.openmp import release_thread_team

MAX_LANES = 2


class ThreadShare:
    """Which lanes are busy and how many intra-op threads each may run on. Its methods that take the
    engine's condition do so themselves; ``enter`` and ``leave`` are called with it held."""

    def __init__(self, total: int, condition: threading.Condition) -> None:
        self.total = total
        self.condition = condition
        self.busy: set[int] = set()
        self.running_on: dict[int, int] = {}  # threads each busy lane runs on now (0: not started)

    def share(self, lane: int) -> int:
        """Threads ``lane`` may run on while the lanes of ``busy`` are."""
        busy = self.busy | {lane}
        base = self.total // len(busy)
        return base + (self.total - base * len(busy) if lane == min(busy) else 0)

    def enter(self, lane: int) -> None:
        """``lane`` has a step to run (with the condition held)."""
        if lane not in self.busy:
            self.busy.add(lane)
            self.running_on[lane] = 0
            self.condition.notify_all()  # the others narrow at their next layer boundary

    def leave(self, lane: int) -> bool:
        """``lane`` has nothing to run (with the condition held); True if it was busy, and the caller (on
        the lane's thread) then releases its team."""
        if lane not in self.busy:
            return False
        self.busy.discard(lane)
        self.running_on.pop(lane, None)
        self.condition.notify_all()  # the others widen at their next layer boundary
        return True

    def _room(self, lane: int) -> bool:
        others = sum(n for other, n in self.running_on.items() if other != lane)
        return others + self.share(lane) <= self.total

    def apply(self, lane: int, wait: bool = False) -> int:
        """On ``lane``'s thread: run on its share from here on (a layer boundary, a step's start). With
        ``wait``, first wait until the other lanes have made room for it (they narrow at their next layer
        boundary). Returns the threads it now runs on."""
        with self.condition:
            if wait:
                while not self._room(lane):
                    self.condition.wait()
            before, now = self.running_on.get(lane, 0), self.share(lane)
            if now == before:
                return now
            if now > before:  # widening: publish first, so that no lane counts on these threads meanwhile
                self.running_on[lane] = now
        if now < before:
            release_thread_team()
        torch.set_num_threads(now)
        if now < before:  # narrowing: publish once narrowed; a lane waiting for room may then start
            with self.condition:
                self.running_on[lane] = now
                self.condition.notify_all()
        return now

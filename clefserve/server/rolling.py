"""The last minute of requests: requests per second and latency percentiles over a rolling window.

Prometheus histograms answer "how many, how slow" since the process started; a scraper computes rates. The
console (``GET /v1/status``) has no scraper behind it, so :class:`RollingWindow` keeps one bucket per second
of the last ``window_s`` seconds, each with its request count and the latencies of that second (at most
``MAX_SAMPLES_PER_BUCKET``, reservoir-sampled beyond, so memory stays bounded under any load).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_SAMPLES_PER_BUCKET = 1024


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class _Bucket:
    second: int
    count: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)


class RollingWindow:
    """Thread-safe: ``record`` from any thread, ``summary`` from any other."""

    def __init__(self, window_s: int = 60, clock: Callable[[], float] = time.monotonic,
                 seed: int | None = None) -> None:
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._buckets: dict[int, _Bucket] = {}
        self._lock = threading.Lock()
        self._random = random.Random(seed)

    def record(self, latency_s: float, ok: bool = True) -> None:
        """One finished request; ``ok`` False (a 5xx, or 4xx) counts it as an error, and its latency is left
        out of the percentiles (a refusal in a millisecond would flatter them)."""
        second = math.floor(self._clock())
        with self._lock:
            bucket = self._buckets.get(second)
            if bucket is None:
                bucket = self._buckets[second] = _Bucket(second)
                self._drop_older_than(second - self.window_s)
            bucket.count += 1
            if not ok:
                bucket.errors += 1
                return
            successes = bucket.count - bucket.errors
            if len(bucket.latencies) < MAX_SAMPLES_PER_BUCKET:
                bucket.latencies.append(latency_s)
            else:  # reservoir sampling: every success of this second is kept with the same probability
                slot = self._random.randrange(successes)
                if slot < MAX_SAMPLES_PER_BUCKET:
                    bucket.latencies[slot] = latency_s

    def _drop_older_than(self, second: int) -> None:
        for key in [k for k in self._buckets if k <= second]:
            del self._buckets[key]

    def summary(self) -> dict[str, Any]:
        """Counts, requests per second and p50/p95 (ms) over the window, and one point per second (oldest
        first, the current second last) for charts."""
        now = self._clock()
        current = math.floor(now)
        with self._lock:
            self._drop_older_than(current - self.window_s)
            buckets = {k: (b.count, b.errors, list(b.latencies)) for k, b in self._buckets.items()}
        # A young server divides by its age, not by the whole window.
        span = min(float(self.window_s), max(now - self._started, 1.0))
        count = sum(c for c, _, _ in buckets.values())
        errors = sum(e for _, e, _ in buckets.values())
        latencies = [x for _, _, lat in buckets.values() for x in lat]
        series = []
        for second in range(current - self.window_s + 1, current + 1):
            c, e, lat = buckets.get(second, (0, 0, []))
            series.append({"t": second - current, "count": c, "errors": e,
                           "p50_ms": _ms(percentile(lat, 50)), "p95_ms": _ms(percentile(lat, 95))})
        return {
            "window_s": self.window_s,
            "count": count,
            "errors": errors,
            "per_second": round(count / span, 3),
            "p50_ms": _ms(percentile(latencies, 50)),
            "p95_ms": _ms(percentile(latencies, 95)),
            "series": series,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)

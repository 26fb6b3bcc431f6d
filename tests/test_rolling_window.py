"""The last-minute window behind /v1/status: counts, rates and percentiles against numpy, on a fake clock."""

from __future__ import annotations

import numpy as np
import pytest

from clefserve.server.rolling import MAX_SAMPLES_PER_BUCKET, RollingWindow, percentile


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101, 1000):
        values = rng.exponential(0.2, n).tolist()
        for q in (0, 5, 50, 95, 100):
            expected = float(np.percentile(values, q))
            assert percentile(values, q) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert percentile([], 50) is None


def test_rate_percentiles_and_series_over_the_last_minute() -> None:
    clock = Clock()
    window = RollingWindow(60, clock=clock)
    clock.now += 120  # older than the window: the rate divides by 60 s
    latencies = []
    for second in range(30):
        for i in range(second % 4):
            latency = 0.01 * (1 + second) + 0.001 * i
            window.record(latency)
            latencies.append(latency)
        window.record(5.0, ok=False)  # a refusal: counted, but not in the percentiles
        clock.now += 1
    summary = window.summary()
    assert summary["count"] == len(latencies) + 30 and summary["errors"] == 30
    assert summary["per_second"] == pytest.approx(summary["count"] / 60, abs=1e-3)
    assert summary["p50_ms"] == pytest.approx(1000 * np.percentile(latencies, 50), abs=1e-3)
    assert summary["p95_ms"] == pytest.approx(1000 * np.percentile(latencies, 95), abs=1e-3)
    series = summary["series"]
    assert [p["t"] for p in series] == list(range(-59, 1))
    # the 30 recorded seconds end one second before now
    recorded = series[-31:-1]
    assert [p["count"] for p in recorded] == [s % 4 + 1 for s in range(30)]
    assert series[-1]["count"] == 0 and series[0]["count"] == 0
    busy = recorded[3]  # second 3: latencies 0.040, 0.041, 0.042
    assert busy["p50_ms"] == pytest.approx(41.0) and busy["p95_ms"] == pytest.approx(1000 * np.percentile(
        [0.040, 0.041, 0.042], 95))
    assert recorded[0]["p50_ms"] is None  # only the refusal in that second


def test_old_seconds_leave_the_window() -> None:
    clock = Clock()
    window = RollingWindow(60, clock=clock)
    window.record(0.1)
    clock.now += 59.5
    assert window.summary()["count"] == 1
    clock.now += 1
    summary = window.summary()
    assert summary["count"] == 0 and summary["p50_ms"] is None


def test_a_young_window_divides_by_its_age() -> None:
    clock = Clock()
    window = RollingWindow(60, clock=clock)
    for _ in range(10):
        window.record(0.05)
    clock.now += 5
    assert window.summary()["per_second"] == pytest.approx(2.0)


def test_memory_is_bounded_under_load_and_counts_stay_exact() -> None:
    clock = Clock()
    window = RollingWindow(60, clock=clock, seed=1)
    n = 5 * MAX_SAMPLES_PER_BUCKET
    rng = np.random.default_rng(1)
    latencies = rng.uniform(0.0, 1.0, n)
    for latency in latencies:
        window.record(float(latency))
    bucket = next(iter(window._buckets.values()))
    assert len(bucket.latencies) == MAX_SAMPLES_PER_BUCKET
    summary = window.summary()
    assert summary["count"] == n
    # a uniform reservoir sample of 1024 from U(0, 1): the median within 0.06 (over 3 standard errors)
    assert summary["p50_ms"] == pytest.approx(500.0, abs=60.0)

"""A reduced soak against real clef-serve processes on 127.0.0.1 (``python -m benchmarks.soak`` is the
full size): valid requests all 200, malformed ones all 4xx, early hang-ups cancelled, memory flat, pools
empty at the end; a flooded server with a queue of 2 answers 429 + Retry-After, never a timeout."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.soak import RSS_GROWTH_LIMIT, malformed_calls, overload, soak

pytestmark = pytest.mark.slow


def test_soak_mixed_load(make_release, tmp_path: Path) -> None:
    # 15% malformed: every kind in the catalogue is sent at least once
    result = soak(make_release(seed=0), tmp_path, requests=200, concurrency=16, malformed=0.15,
                  disconnects=0.05, warmup=100, deadline_s=120)
    print(result.summary())
    assert result.problems == [], result.summary()
    statuses = result.statuses
    assert statuses.get("good 200", 0) == 200 - 30 - 10
    assert not any(label.endswith("error") for label in statuses), statuses
    assert sum(n for label, n in statuses.items() if label.startswith("bad 4")) == 30
    assert len(malformed_calls()) <= 30
    assert result.rss_growth <= RSS_GROWTH_LIMIT
    assert all(value == 0 for value in result.engine_end.values()), result.engine_end
    assert result.server["decisions"] > 0 and result.server["prefill_tokens"] > 0


def test_full_queue_is_429_with_retry_after(make_release, tmp_path: Path) -> None:
    result = overload(make_release(seed=0), tmp_path, requests=24, timeout_s=60)
    print(result.summary())
    assert result.problems == [], result.summary()
    assert set(result.statuses) <= {"good 200", "good 429"}
    assert result.statuses.get("good 429", 0) >= 10 and result.statuses.get("good 200", 0) >= 1
    assert result.slowest_429_s < 5

"""benchmarks.profile's timers, on a fake clock: the wrapped delta rule keeps its snapshot-keeping entry point
(so the profiled engine takes the path the server takes) and both entry points count under the same part;
nested parts count only in the innermost one."""

from __future__ import annotations

import pytest

from benchmarks import profile
from benchmarks.profile import Timers


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(profile.time, "perf_counter", fake)
    return fake


def test_a_wrapped_op_keeps_its_keeping_entry_point_and_times_both(clock):
    def rule(x):
        clock.spend(2.0)
        return ("plain", x)

    def keeping(x):
        clock.spend(3.0)
        return ("keeping", x)

    rule.keeping = keeping
    timers = Timers(lambda: None)
    timed = timers.wrap("delta rule", rule)
    assert timed(1) == ("plain", 1)
    assert getattr(timed, "keeping", None) is not None and timed.keeping(2) == ("keeping", 2)
    assert timers.calls["delta rule"] == 2
    assert timers.seconds["delta rule"] == 5.0
    assert not hasattr(timers.wrap("norms + rotary", lambda x: x), "keeping")


def test_nested_parts_count_only_in_the_innermost(clock):
    timers = Timers(lambda: None)
    inner = timers.wrap("attention", lambda: clock.spend(3.0))
    outer = timers.wrap("other layer work", lambda: (clock.spend(1.0), inner(), clock.spend(0.5)))
    outer()
    assert timers.seconds == {"attention": 3.0, "other layer work": 1.5}

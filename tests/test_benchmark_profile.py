"""benchmarks.profile's timers, on a fake clock: the wrapped delta rule keeps its snapshot-keeping entry point
(so the profiled engine takes the path the server takes) and both entry points count under the same part;
nested parts count only in the innermost one. ``--ops`` records the engine thread's ops, not the caller's; the
garbage collector's line counts the passes between two totals."""

from __future__ import annotations

import pytest
import torch

from benchmarks import profile
from benchmarks.profile import EngineOps, Timers
from clefserve.engine import Engine
from clefserve.model.weights import load_backbone
from tests.engine_support import ENGINE_SPECS, keep_hidden, small_config


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


def test_engine_ops_records_the_engine_threads_ops_and_not_the_callers(make_release):
    model = load_backbone(make_release(ENGINE_SPECS["default"], seed=5))
    with Engine(model, small_config(), keep_hidden) as engine:
        with EngineOps(engine) as ops:
            engine.submit(torch.arange(40)).result()
            torch.cumprod(torch.ones(7, 3), dim=0)  # on this thread: not the engine's
        table = ops.table(200)
    assert "aten::mm" in table or "aten::addmm" in table  # the step's projections
    assert "aten::cumprod" not in table


def test_the_collector_line_counts_the_passes_between_two_totals():
    before = [(3, 0.001), (1, 0.002), (0, 0.0)]
    after = [(5, 0.0015), (1, 0.002), (1, 0.085)]
    assert profile.collector_summary(before, after) == (
        "garbage collection (every thread stops): gen0 2 (0.5 ms), gen1 0 (0.0 ms), gen2 1 (85.0 ms)")

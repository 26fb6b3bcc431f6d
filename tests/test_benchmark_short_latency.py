"""benchmarks.systemone's short-record latency report on made-up runs: which records count as short, which
belong to the opening burst (the first ``concurrency`` requests, in request order), and the burst floor it
measures for the largest burst; and the closed loop of benchmarks.short_latency."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from benchmarks.systemone import Run, report_short_latency
from benchmarks.workload import timed_closed_loop

SHORT, LONG = 681, 3000


def test_report_splits_the_opening_burst_from_later_records(capsys):
    alone = Run(1.0, [0.08, 0.09, 0.10, 0.10], [SHORT] * 4)
    # concurrency 4: the first four requests of each round went out together
    round_one = Run(3.0, [0.30, 2.0, 0.40, 2.5, 0.20, 2.2], [SHORT, LONG, SHORT, LONG, SHORT, LONG])
    round_two = Run(3.0, [2.1, 0.15, 2.4, 1.9, 0.25, 0.18], [LONG, SHORT, LONG, LONG, SHORT, SHORT])
    asked = []

    def burst_alone(k: int) -> Run:
        asked.append(k)
        return Run(0.3, [0.1 * (i + 1) for i in range(k)], [SHORT] * k)

    report_short_latency([round_one, round_two], alone, 4, burst_alone, repeat=3)
    out = capsys.readouterr().out
    # p95 of the six short latencies (0.15, 0.18, 0.20, 0.25, 0.30, 0.40) is the largest, against 0.10 alone
    assert "p95 0.40s in the mixed run, 0.10s alone (4.00x)" in out
    # round one's burst held two short records, round two's one: opening p95 over 0.30, 0.40, 0.15
    assert "opening burst (up to 2 short) p95 0.40s (4.00x)" in out
    # sent later: 0.20 (round one), 0.25 and 0.18 (round two)
    assert "sent later p95 0.25s (2.50x)" in out
    # the floor is measured for the largest burst, once per repeat, and reports the last answer
    assert asked == [2, 2, 2]
    assert "floor: 2 short records sent together alone answer the last after 0.20s (2.00x)" in out


def test_no_floor_when_no_burst_held_two_short_records(capsys):
    alone = Run(1.0, [0.1, 0.1], [SHORT, SHORT])
    only = Run(2.0, [2.0, 0.3, 1.5, 0.2], [LONG, SHORT, LONG, SHORT])

    def burst_alone(k: int) -> Run:
        raise AssertionError("a burst of one short record has no floor to measure")

    report_short_latency([only], alone, 2, burst_alone, repeat=1)
    out = capsys.readouterr().out
    assert "opening burst (up to 1 short) p95 0.30s (3.00x)" in out
    assert "sent later p95 0.20s (2.00x)" in out
    assert "floor" not in out


def test_timed_closed_loop_sends_in_order_and_times_each_record():
    """benchmarks.workload.timed_closed_loop (benchmarks.short_latency's loop): records go out in list
    order, the first ``concurrency`` together, and each latency is its own record's, preparation included."""
    sent: list[float] = []
    lock = threading.Lock()

    def submit(seconds: float) -> Future:
        with lock:
            sent.append(seconds)
        done: Future = Future()
        threading.Timer(seconds, done.set_result, args=(None,)).start()
        return done

    records = [0.20, 0.05, 0.05, 0.05, 0.05]
    prepared = []
    wall, latencies = timed_closed_loop(submit, records, 2, prepare=prepared.append)
    assert sent[:2] == [0.20, 0.05] and sorted(prepared) == sorted(records)
    assert all(t >= r for t, r in zip(latencies, records, strict=True))  # each its own record's wait
    assert wall >= max(0.20, 4 * 0.05)  # client one waits on record 0 while client two answers 1, 2, 3, 4

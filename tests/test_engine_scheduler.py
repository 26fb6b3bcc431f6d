"""Scheduling: FIFO admission without starvation, and the per-step token budget."""

from __future__ import annotations

import threading

import pytest
import torch

from clefserve.engine import Engine
from clefserve.engine.kv_pool import BlockAllocator
from clefserve.engine.scheduler import STARVATION_STEPS, Scheduler
from clefserve.engine.sequence import Sequence, Status
from clefserve.engine.state_pool import SlotAllocator
from clefserve.model.weights import load_backbone
from tests.engine_support import ENGINE_SPECS, PausingFinish, small_config


def _scheduler(blocks=64, slots=3, block_size=4, budget=16, max_queue=100) -> Scheduler:
    allocators = BlockAllocator(blocks), SlotAllocator(slots)
    return Scheduler(*allocators, block_size, slots, budget, max_queue, max_length=10_000)


def _seq(n: int, name: str) -> Sequence:
    return Sequence(torch.zeros(n, dtype=torch.long), payload=name)


def _drain(scheduler: Scheduler) -> tuple[list[list[tuple[str, int]]], list[str]]:
    steps, finished = [], []
    while scheduler.has_work():
        plan = scheduler.schedule()
        assert plan.chunks
        steps.append([(s.payload, n) for s, n in plan.chunks])
        finished += [s.payload for s in scheduler.complete(plan)]
    return steps, finished


def test_budget_goes_to_the_shortest_remaining_work_and_long_records_are_chunked():
    scheduler = _scheduler(budget=16)
    for n, name in [(40, "long"), (5, "a"), (3, "b"), (20, "c")]:
        scheduler.add(_seq(n, name))
    steps, finished = _drain(scheduler)
    assert all(sum(n for _, n in step) <= 16 for step in steps)
    # short records first; beside them the long one gets at most a quarter of the budget
    assert steps[0] == [("b", 3), ("a", 5), ("long", 4)]
    assert steps[1] == [("c", 16)]  # no short record (c: 20 left > the budget): c goes before long (36 left)
    assert steps[2] == [("c", 4), ("long", 4)]
    assert steps[3:] == [[("long", 16)], [("long", 16)]]
    assert finished == ["b", "a", "c", "long"]
    assert scheduler.blocks.num_free == 64 and scheduler.slots.num_free == 3


def test_a_record_that_fits_in_one_budget_keeps_its_step_short():
    scheduler = _scheduler(budget=16)
    for n, name in [(40, "long"), (10, "s")]:
        scheduler.add(_seq(n, name))
    steps, finished = _drain(scheduler)
    assert steps[0] == [("s", 10), ("long", 4)]  # not 6: the long record shares only a quarter beside s
    assert finished == ["s", "long"]


def test_a_short_record_the_rest_of_a_step_cannot_finish_waits_whole_for_the_next():
    """Cut, it would answer only after a second step, and the first step would run longer for nothing; the
    long record still gets its share beside the short ones."""
    scheduler = _scheduler(slots=4, budget=40)
    for n, name in [(100, "long"), (10, "a"), (12, "b"), (20, "c")]:
        scheduler.add(_seq(n, name))
    steps, finished = _drain(scheduler)
    assert steps[0] == [("a", 10), ("b", 12), ("long", 10)]  # c (20) does not fit the 18 left: not 18 + 2
    assert steps[1] == [("c", 20), ("long", 10)]
    assert finished[:3] == ["a", "b", "c"]


def test_a_short_record_left_whole_again_and_again_is_not_starved():
    """Shorter records keep arriving and fill every step: the one that never fits what they leave still
    runs within the starvation limit."""
    scheduler = _scheduler(blocks=1000, slots=4, budget=40)
    scheduler.add(_seq(30, "late"))
    waited, longest, i = 0, 0, 0
    while any(s.payload == "late" for s in [*scheduler.running, *scheduler.waiting]):
        while len(scheduler.waiting) + len(scheduler.running) < 4:
            scheduler.add(_seq(10, f"s{i}"))  # three of them fill 30 of the 40: 30 never fits beside them
            i += 1
        plan = scheduler.schedule()
        if any(s.payload == "late" for s, _ in plan.chunks):
            assert ("late", 30) in [(s.payload, n) for s, n in plan.chunks]  # whole, never cut
        else:
            waited += 1
            longest = max(longest, waited)
        scheduler.complete(plan)
        assert i < 500, "the record never ran"
    assert 0 < longest <= STARVATION_STEPS


def test_cuts_that_leave_a_record_unfinished_end_on_delta_rule_chunk_boundaries():
    """A chunk of 64 positions cut in two would be computed by both pieces: a long record's pieces end on
    multiples of 64, up when the step has room, else down (each piece keeping most of its share)."""
    scheduler = _scheduler(blocks=1000, slots=3, block_size=16, budget=1000)
    for n, name in [(3000, "long"), (300, "short")]:
        scheduler.add(_seq(n, name))
    steps, finished = _drain(scheduler)
    assert steps[0] == [("short", 300), ("long", 256)]  # a quarter of the budget (250), up to 256
    assert steps[1:] == [[("long", 960)], [("long", 960)], [("long", 824)]]  # 1,216 and 2,176: down
    assert finished == ["short", "long"]


def test_no_piece_is_a_sliver_of_leftover_budget():
    """A long record cut down to a chunk boundary leaves a few tokens of the budget; the next long record
    does not run them as a piece of its own (every per-piece op and a cut chunk, for 40 tokens)."""
    scheduler = _scheduler(blocks=1000, slots=3, block_size=16, budget=1000)
    for name in ("a", "b"):
        scheduler.add(_seq(3000, name))
    steps, finished = _drain(scheduler)
    assert steps[0] == [("a", 960)]  # not [("a", 960), ("b", 40)]
    left = {"a": 3000, "b": 3000}
    for step in steps:
        for name, n in step:
            left[name] -= n
            assert n >= 64 or left[name] == 0, steps
    assert sorted(finished) == ["a", "b"]


def test_a_long_record_is_never_passed_over_more_than_the_starvation_limit():
    scheduler = _scheduler(blocks=1000, slots=3, block_size=4, budget=8)
    scheduler.add(_seq(64, "long"))
    waited, longest, i = 0, 0, 0
    while any(s.payload == "long" for s in [*scheduler.running, *scheduler.waiting]):
        while len(scheduler.waiting) < 2:  # short records keep coming and would fill every step
            scheduler.add(_seq(4, f"s{i}"))
            i += 1
        plan = scheduler.schedule()
        if any(s.payload == "long" for s, _ in plan.chunks):
            waited = 0
        else:
            waited += 1
            longest = max(longest, waited)
        scheduler.complete(plan)
        assert i < 500, "the long record never finished"
    assert 0 < longest <= STARVATION_STEPS


def test_head_of_queue_is_never_overtaken():
    scheduler = _scheduler(blocks=10, slots=3, block_size=4, budget=8)
    scheduler.add(_seq(8, "s0"))  # 2 blocks
    scheduler.add(_seq(36, "long"))  # 9 blocks: must wait for s0
    for i in range(1, 6):
        scheduler.add(_seq(4, f"s{i}"))  # 1 block each, would fit beside s0
    admitted = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        admitted += [s.payload for s in plan.admitted]
        scheduler.complete(plan)
    assert admitted == ["s0", "long", "s1", "s2", "s3", "s4", "s5"]


def test_cancel_frees_what_a_sequence_holds():
    scheduler = _scheduler(blocks=8, slots=2)
    seqs = [_seq(8, str(i)) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    scheduler.schedule()
    assert scheduler.remove(seqs[0], Status.CANCELLED) and scheduler.remove(seqs[3], Status.CANCELLED)
    assert not scheduler.remove(seqs[0], Status.CANCELLED)
    assert _drain(scheduler)[1] == ["1", "2"]
    assert scheduler.blocks.num_free == 8 and scheduler.slots.num_free == 2


@pytest.fixture(scope="module")
def model(make_release):
    return load_backbone(make_release(ENGINE_SPECS["default"], seed=9))


def test_long_record_at_the_head_is_not_starved_by_a_stream_of_short_ones(model):
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    finish = PausingFinish()
    # 8 blocks of 8 tokens: the long record needs the whole pool, a short one a single block
    per_block = 8 * 1 * 2 * 2 * 16 * 4
    config = small_config(max_num_seqs=4, prefill_chunk_size=16, block_size=8, kv_cache_mb=None,
                          kv_fraction=1.0)
    with Engine(model, config, finish, memory_budget_bytes=8 * per_block) as engine:
        finish.hold()
        engine.submit(torch.randint(0, vocab, (8,), generator=gen), payload="b0")
        finish.wait_held()
        def record(n: int, name: str):
            return engine.submit(torch.randint(0, vocab, (n,), generator=gen), payload=name)

        before = [record(8, f"a{i}") for i in range(3)]
        long = record(64, "long")
        after = [record(8, f"z{i}") for i in range(6)]
        stop = threading.Event()

        def stream():  # keeps short records coming while the long one waits
            i = 0
            while not stop.is_set() and i < 200:
                engine.submit(torch.randint(0, vocab, (8,)), payload=f"x{i}")
                i += 1
                stop.wait(0.002)

        feeder = threading.Thread(target=stream)
        feeder.start()
        finish.release()
        try:
            assert long.result(timeout=30) == "long"
        finally:
            stop.set()
            feeder.join()
        for f in before + after:
            f.result(timeout=30)
        order = finish.order
        assert all(order.index(f"a{i}") < order.index("long") for i in range(3))
        assert all(order.index("long") < order.index(f"z{i}") for i in range(6))
        assert not any(p.startswith("x") for p in order[: order.index("long")])

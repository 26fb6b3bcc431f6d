"""A step of long records pauses between two layers for short records that arrived during it: they run in a
step of their own there and answer before the paused step ends, which then resumes; no answer changes. The
engines here run one lane, so that a second one does not take the short records first
(tests/test_cpu_lanes.py)."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from clefserve.engine import Engine
from clefserve.engine.kv_pool import BlockAllocator
from clefserve.engine.scheduler import STARVATION_STEPS, Scheduler
from clefserve.engine.sequence import Sequence
from clefserve.engine.state_pool import SlotAllocator
from clefserve.model.weights import load_backbone
from tests import device as test_device
from tests.engine_support import ENGINE_SPECS, keep_hidden, random_ids, small_config
from tests.kernel_modes import KERNEL_MODES, use_kernels

TOLERANCE = 1e-5
BUDGET = 48
LONG, SHORT = 5 * BUDGET + 7, 20


# ---- the scheduler's step inside a paused one ----

def _scheduler(budget: int = 16, slots: int = 5) -> Scheduler:
    return Scheduler(BlockAllocator(256), SlotAllocator(slots), 4, slots, budget, 100, max_length=10_000,
                     pauses_long_steps=True)


def _seq(n: int, name: str) -> Sequence:
    return Sequence(torch.zeros(n, dtype=torch.long), payload=name)


def test_the_inner_step_runs_short_records_only_and_none_of_the_paused_step():
    scheduler = _scheduler(budget=16)
    long_a, long_b = _seq(40, "long-a"), _seq(12, "long-b")  # over half the budget: long
    for seq in (long_a, long_b):
        scheduler.add(seq)
    outer = scheduler.schedule()
    paused = {seq for seq, _ in outer.chunks}
    assert paused == {long_a, long_b}
    for n, name in [(30, "new-long"), (7, "b"), (5, "a")]:
        scheduler.add(_seq(n, name))
    assert scheduler.has_short_work(paused)
    inner = scheduler.schedule_short(paused)
    # admission as usual (FIFO, the new long record too); tokens only for short records not paused
    assert [s.payload for s in inner.admitted] == ["new-long", "b", "a"]
    assert [(s.payload, n) for s, n in inner.chunks] == [("a", 5), ("b", 7)]
    new_long = next(s for s in inner.admitted if s.payload == "new-long")
    assert new_long.steps_passed_over == 0  # left out of an inner step: not passed over
    scheduler.complete(inner)
    assert not scheduler.has_short_work(paused)  # only the new long record and the paused ones are left
    assert scheduler.schedule_short(paused).chunks == []


def test_the_inner_step_keeps_to_the_budget_and_to_delta_rule_chunks():
    scheduler = _scheduler(budget=128)
    scheduler.add(_seq(300, "long"))
    paused = {seq for seq, _ in scheduler.schedule().chunks}
    for n, name in [(60, "a"), (62, "b"), (64, "c")]:
        scheduler.add(_seq(n, name))
    inner = scheduler.schedule_short(paused)
    # c does not fit the 6 tokens left: it waits whole for the next step
    assert [(s.payload, n) for s, n in inner.chunks] == [("a", 60), ("b", 62)]
    assert sum(n for _, n in inner.chunks) <= 128
    scheduler.complete(inner)
    assert [(s.payload, n) for s, n in scheduler.schedule_short(paused).chunks] == [("c", 64)]


def test_a_short_record_the_inner_steps_rest_cannot_finish_waits_whole():
    """Cut, a short record would answer only after a second step; whole, it answers after the next one."""
    scheduler = _scheduler(budget=40)  # short: at most 20 left
    scheduler.add(_seq(100, "long"))
    paused = {seq for seq, _ in scheduler.schedule().chunks}
    for n, name in [(10, "a"), (12, "b"), (20, "c")]:
        scheduler.add(_seq(n, name))
    inner = scheduler.schedule_short(paused)
    assert [(s.payload, n) for s, n in inner.chunks] == [("a", 10), ("b", 12)]  # not c's 16 of the 18 left
    scheduler.complete(inner)
    assert [(s.payload, n) for s, n in scheduler.schedule_short(paused).chunks] == [("c", 20)]


def test_starved_long_records_stay_out_of_the_inner_step():
    scheduler = _scheduler(budget=16)
    starved = _seq(64, "starved")
    scheduler.add(starved)
    scheduler.schedule()
    starved.steps_passed_over = STARVATION_STEPS
    scheduler.add(_seq(4, "short"))
    inner = scheduler.schedule_short(set())
    assert [(s.payload, n) for s, n in inner.chunks] == [("short", 4)]
    assert starved.steps_passed_over == STARVATION_STEPS


def test_no_short_work_while_a_full_engine_queues_records():
    scheduler = _scheduler(budget=16, slots=2)
    for n, name in [(40, "long-a"), (30, "long-b")]:
        scheduler.add(_seq(n, name))
    paused = {seq for seq, _ in scheduler.schedule().chunks} | set(scheduler.running)
    scheduler.add(_seq(4, "queued"))  # no room to admit it until a running record finishes
    assert not scheduler.has_short_work(paused)
    assert scheduler.schedule_short(paused).chunks == []


def test_a_long_records_last_piece_does_not_share_a_short_records_step():
    """Where long steps pause, a short record has at most half a budget left; a long record's last piece of
    up to a budget is long, and gets none of the step a short record runs in."""
    scheduler = _scheduler(budget=16)
    tail, short = _seq(12, "tail"), _seq(5, "short")
    for seq in (tail, short):
        scheduler.add(seq)
    first = scheduler.schedule()
    assert [(s.payload, n) for s, n in first.chunks] == [("short", 5)]
    assert tail.steps_passed_over == 1
    scheduler.complete(first)
    assert [(s.payload, n) for s, n in scheduler.schedule().chunks] == [("tail", 12)]


def test_starved_long_records_share_a_quarter_of_the_budget_beside_a_short_one():
    scheduler = _scheduler(budget=64)
    starved = [_seq(100, f"starved-{i}") for i in range(3)]
    for seq in starved:
        scheduler.add(seq)
    scheduler.schedule()
    scheduler.add(_seq(20, "short"))
    for seq in starved:
        seq.steps_passed_over = STARVATION_STEPS
    plan = scheduler.schedule()
    # the oldest starved record takes the quarter (16 tokens), the short record its 20; the others wait
    assert [(s.payload, n) for s, n in plan.chunks] == [("starved-0", 16), ("short", 20)]


# ---- the engine ----

class ArrivalDuringLayer:
    """A forward hook on one layer that submits records the first time a step of ``rows`` rows reaches it
    (so they arrive while that step runs), from the engine thread itself."""

    def __init__(self, engine_box: list, rows: int, records: list[torch.Tensor]) -> None:
        self.engine_box, self.rows, self.records = engine_box, rows, records
        self.futures: list = []
        self.fired = threading.Event()

    def __call__(self, module, args, output) -> None:
        if not self.fired.is_set() and output.shape[0] == self.rows:
            self.fired.set()
            self.futures = [self.engine_box[0].submit(ids) for ids in self.records]


def _engine_with_arrival(model, preemption: bool, layer: int = 1):
    long_ids = random_ids(model.config.vocab_size, LONG, torch.Generator().manual_seed(1))
    short_ids = random_ids(model.config.vocab_size, SHORT, torch.Generator().manual_seed(2))
    box: list = []
    arrival = ArrivalDuringLayer(box, BUDGET, [short_ids])
    handle = model.layers[layer].register_forward_hook(arrival)
    try:
        config = small_config(cpu_lanes=1, prefill_chunk_size=BUDGET, layer_preemption=preemption)
        engine = Engine(model, config, keep_hidden)
        box.append(engine)
        with engine:
            long_future = engine.submit(long_ids)
            long_rows = long_future.result(timeout=60)
            assert arrival.fired.wait(10)
            short_rows = arrival.futures[0].result(timeout=60)
            trace = [[n for _, n in step] for step in engine.recent_steps()]
    finally:
        handle.remove()
    return long_ids, short_ids, long_rows, short_rows, trace


@pytest.fixture(scope="module")
def model(make_release):
    folder = make_release(ENGINE_SPECS["default"], seed=5)
    return load_backbone(folder, test_device.dtype(), test_device.device())


def test_a_short_record_arriving_during_a_long_step_answers_before_that_step_ends(model):
    long_ids, short_ids, long_rows, short_rows, trace = _engine_with_arrival(model, preemption=True)
    # the short record's step ran inside the long record's first step, and so completed before it
    assert trace[:2] == [[SHORT], [BUDGET]]
    assert sum(n for step in trace for n in step) == LONG + SHORT
    for ids, rows in ((long_ids, long_rows), (short_ids, short_rows)):
        test_device.assert_close(rows, model.run_sequence(ids)[0], TOLERANCE)


def test_a_long_step_also_pauses_between_a_layers_token_mixer_and_its_mlp(model):
    """A short record that arrives during a layer's token mixer runs at the boundary before that layer's MLP,
    not after the whole layer: on a large model one layer of a long step takes a second on a CPU."""
    long_ids = random_ids(model.config.vocab_size, LONG, torch.Generator().manual_seed(1))
    short_ids = random_ids(model.config.vocab_size, SHORT, torch.Generator().manual_seed(2))
    layer = model.layers[1]
    mixer = layer.linear_attn if layer.kind == "linear_attention" else layer.self_attn
    box: list = []
    arrival = ArrivalDuringLayer(box, BUDGET, [short_ids])
    answered_before_the_mlp: list[bool] = []

    def mlp_ran(module, args, output):
        if output.shape[0] == BUDGET and arrival.fired.is_set() and not answered_before_the_mlp:
            answered_before_the_mlp.append(arrival.futures[0].done())

    handles = [mixer.register_forward_hook(arrival), layer.mlp.register_forward_hook(mlp_ran)]
    try:
        engine = Engine(model, small_config(cpu_lanes=1, prefill_chunk_size=BUDGET), keep_hidden)
        box.append(engine)
        with engine:
            long_rows = engine.submit(long_ids).result(timeout=60)
            short_rows = arrival.futures[0].result(timeout=60)
    finally:
        for handle in handles:
            handle.remove()
    assert answered_before_the_mlp == [True]
    for ids, rows in ((long_ids, long_rows), (short_ids, short_rows)):
        test_device.assert_close(rows, model.run_sequence(ids)[0], TOLERANCE)


def test_pausing_changes_when_a_step_runs_not_what_it_computes(model):
    """The paused record's rows are, to the bit, those of the same record served alone (the same pieces);
    without pausing, the short record waits for the long step and then shares the next one with it."""
    long_ids, _, long_rows, short_rows, paused_trace = _engine_with_arrival(model, preemption=True)
    _, _, _, plain_short, plain_trace = _engine_with_arrival(model, preemption=False)
    assert paused_trace[:2] == [[SHORT], [BUDGET]]
    assert plain_trace[0] == [BUDGET] and SHORT in plain_trace[1]
    with Engine(model, small_config(cpu_lanes=1, prefill_chunk_size=BUDGET), keep_hidden) as engine:
        alone = engine.submit(long_ids).result(timeout=60)
        alone_trace = [[n for _, n in step] for step in engine.recent_steps()]
    assert alone_trace == [step for step in paused_trace if step != [SHORT]]
    assert torch.equal(long_rows, alone)
    test_device.assert_close(short_rows, plain_short, TOLERANCE)


def test_a_failing_inner_step_fails_its_records_only(model):
    """A fault in the short records' step (here: a layer raising for their rows) fails them; the paused long
    record resumes and answers."""
    long_ids = random_ids(model.config.vocab_size, LONG, torch.Generator().manual_seed(1))
    short_ids = random_ids(model.config.vocab_size, SHORT, torch.Generator().manual_seed(2))
    box: list = []
    arrival = ArrivalDuringLayer(box, BUDGET, [short_ids])

    def fail_short(module, args, output):
        if output.shape[0] == SHORT:
            raise RuntimeError("injected fault in the short step")

    handles = [model.layers[1].register_forward_hook(arrival),
               model.layers[2].register_forward_hook(fail_short)]
    try:
        config = small_config(cpu_lanes=1, prefill_chunk_size=BUDGET, prefix_cache=False)
        engine = Engine(model, config, keep_hidden)
        box.append(engine)
        with engine:
            long_rows = engine.submit(long_ids).result(timeout=60)
            with pytest.raises(RuntimeError, match="injected fault"):
                arrival.futures[0].result(timeout=60)
            stats = engine.stats()
    finally:
        for handle in handles:
            handle.remove()
    test_device.assert_close(long_rows, model.run_sequence(long_ids)[0], TOLERANCE)
    assert stats["failed"] == 1 and stats["finished"] == 1
    assert stats["running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_step_with_a_short_record_in_it_is_not_paused(model):
    """Only steps of long records pause: one that already runs a short record finishes first."""
    first = random_ids(model.config.vocab_size, SHORT + 4, torch.Generator().manual_seed(3))
    later = random_ids(model.config.vocab_size, SHORT, torch.Generator().manual_seed(4))
    box: list = []
    arrival = ArrivalDuringLayer(box, SHORT + 4, [later])
    handle = model.layers[1].register_forward_hook(arrival)
    try:
        engine = Engine(model, small_config(cpu_lanes=1, prefill_chunk_size=BUDGET), keep_hidden)
        box.append(engine)
        with engine:
            engine.submit(first).result(timeout=60)
            assert arrival.fired.wait(10)
            arrival.futures[0].result(timeout=60)
            trace = [[n for _, n in step] for step in engine.recent_steps()]
    finally:
        handle.remove()
    assert trace == [[SHORT + 4], [SHORT]]


class ArrivalsDuringLongSteps:
    """Submits the next of ``records`` each time a step of long records only reaches the hooked layer."""

    def __init__(self, engine_box: list, budget: int, records: list[torch.Tensor]) -> None:
        self.engine_box, self.budget = engine_box, budget
        self.pending = list(records)
        self.futures: list = []

    def __call__(self, module, args, output) -> None:
        if self.pending and output.shape[0] == self.budget:
            self.futures.append(self.engine_box[0].submit(self.pending.pop(0)))


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_rows_equal_one_piece_runs_with_many_steps_paused(model, mode):
    """Under load (records sent together, and short records arriving during long steps), every record's rows
    equal a one-piece run, and the pools are whole afterwards."""
    use_kernels(model, "reference")
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    first = [random_ids(vocab, n, gen) for n in (3 * BUDGET + 5, 1, 2 * BUDGET, 17, 4 * BUDGET + 1, 40)]
    later = [random_ids(vocab, rng.randint(1, BUDGET // 2), gen) for _ in range(8)]  # short: half a budget
    records = first + later
    expected = [model.run_sequence(ids)[0] for ids in records]
    use_kernels(model, mode)
    box: list = []
    arrivals = ArrivalsDuringLongSteps(box, BUDGET, later)
    handle = model.layers[2].register_forward_hook(arrivals)
    try:
        engine = Engine(model, small_config(cpu_lanes=1, prefill_chunk_size=BUDGET), keep_hidden)
        box.append(engine)
        with engine:
            engine.poison_free_memory()
            with ThreadPoolExecutor(4) as pool:
                futures = list(pool.map(engine.submit, first))
            got = [f.result(timeout=60) for f in futures]
            for _ in range(2 * len(later)):  # every later record goes in during a long step: send long ones
                if not arrivals.pending:
                    break
                engine.submit(random_ids(vocab, 4 * BUDGET, gen)).result(timeout=60)
            assert not arrivals.pending
            got += [f.result(timeout=60) for f in arrivals.futures]
            stats = engine.stats()
    finally:
        handle.remove()
        use_kernels(model, "auto")
    for ids, want, rows in zip(records, expected, got, strict=True):
        assert rows.shape == (len(ids), model.config.hidden_size)
        test_device.assert_close(rows, want, TOLERANCE)
    assert stats["paused_steps"] >= len(later) // 2
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_blocks_free"] + stats.get("prefix_blocks_cache_only", 0) == stats["kv_blocks_total"]
    assert stats["gdn_slots_free"] == stats["gdn_slots_total"]

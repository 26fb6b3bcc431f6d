"""CPU lanes: a second worker runs a step beside the first one's, over other sequences, and the two share the
intra-op threads; no answer changes, no pool leaks, the cores are never oversubscribed, and idle work never
runs beside a step."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from clefserve.engine import Engine
from clefserve.engine.kv_pool import BlockAllocator, KVPool
from clefserve.engine.lanes import ThreadShare
from clefserve.engine.scheduler import STARVATION_STEPS, Scheduler
from clefserve.engine.sequence import Sequence
from clefserve.engine.state_pool import SlotAllocator
from clefserve.model.weights import load_backbone
from tests import device as test_device
from tests.engine_support import ENGINE_SPECS, keep_hidden, random_ids, small_config
from tests.kernel_modes import KERNEL_MODES, use_kernels

TOLERANCE = 1e-5
BUDGET = 48

needs_two_threads = pytest.mark.skipif(
    test_device.device().type != "cpu" or torch.get_num_threads() < 2,
    reason="lanes run on a CPU with two or more intra-op threads",
)


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ---- the thread share ----

def test_a_lane_alone_gets_every_thread_and_two_split_them():
    share = ThreadShare(5, threading.Condition())
    assert share.share(0) == 5
    with share.condition:
        share.enter(1)
    assert share.share(1) == 5  # alone
    with share.condition:
        share.enter(0)
    assert (share.share(0), share.share(1)) == (3, 2)  # the first lane gets the odd one
    with share.condition:
        assert share.leave(0) and not share.leave(0)
    assert share.share(1) == 5


def test_a_lane_starts_beside_another_only_once_that_one_has_narrowed():
    share = ThreadShare(2, threading.Condition())
    with share.condition:
        share.enter(0)
    assert share.apply(0) == 2
    started = threading.Event()

    def second_lane():
        with share.condition:
            share.enter(1)
        share.apply(1, wait=True)
        started.set()

    worker = threading.Thread(target=second_lane)
    worker.start()
    assert not started.wait(0.2)  # lane 0 still runs on both threads
    assert share.apply(0) == 1  # its next layer boundary
    assert started.wait(10)
    worker.join(10)
    assert share.running_on == {0: 1, 1: 1}
    with share.condition:
        share.leave(1)
    assert share.apply(0) == 2 and torch.get_num_threads() == 2


# ---- the scheduler plans around the steps in flight ----

def test_sequences_in_flight_get_no_tokens_and_are_not_passed_over():
    scheduler = Scheduler(BlockAllocator(256), SlotAllocator(4), 4, 4, 16, 100, max_length=10_000)
    a, b = Sequence(torch.zeros(40, dtype=torch.long)), Sequence(torch.zeros(30, dtype=torch.long))
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule(busy=())  # admits both; b, the shorter, gets the budget
    passed_over = a.steps_passed_over
    for _ in range(STARVATION_STEPS + 1):
        plan = scheduler.schedule(busy={a})
        assert [seq for seq, _ in plan.chunks] == [b]
    assert a.steps_passed_over == passed_over
    assert scheduler.has_runnable(busy={a}) and not scheduler.has_runnable(busy={a, b})


# ---- the KV pool's pages, faulted in by two lanes at once ----

class _SlowFirstZeroing:
    """Stands in for the pool's K tensor: the first slice zeroed blocks until released."""

    def __init__(self, real: torch.Tensor) -> None:
        self.real, self.calls = real, 0
        self.zeroing, self.release = threading.Event(), threading.Event()

    def __getitem__(self, index):
        tensor = self.real[index]
        self.calls += 1
        if self.calls > 1:
            return tensor
        outer = self

        class Slow:
            def zero_(self):
                outer.zeroing.set()
                assert outer.release.wait(10)
                return tensor.zero_()

        return Slow()


def test_a_lane_waits_while_the_other_zeroes_the_pages_it_needs():
    """Without the lock, the second lane would see the blocks as not yet resident, zero them itself, return
    and start writing them while the first is still zeroing them."""
    pool = KVPool(1, 64, 4, 1, 8, torch.float32, torch.device("cpu"))
    slow = pool.k = _SlowFirstZeroing(pool.k)
    first = threading.Thread(target=pool.make_resident, args=(8,))
    first.start()
    assert slow.zeroing.wait(10)
    second = threading.Thread(target=pool.make_resident, args=(8,))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # waits for the first lane's zeroing
    slow.release.set()
    first.join(10)
    second.join(10)
    assert not second.is_alive() and slow.calls == 1  # the second found the blocks resident
    assert pool.resident_blocks >= 8


# ---- the engine ----

@pytest.fixture(scope="module")
def model(make_release):
    return load_backbone(make_release(ENGINE_SPECS["two-attn"], seed=11), test_device.dtype(),
                         test_device.device())


def _pools_whole(stats: dict) -> None:
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_blocks_free"] + stats.get("prefix_blocks_cache_only", 0) == stats["kv_blocks_total"]
    assert stats["gdn_slots_free"] == stats["gdn_slots_total"]


def _lane_of_this_thread() -> int:
    name = threading.current_thread().name
    return 0 if name == "engine" else int(name.rpartition("-")[2])


class ThreadAudit:
    """Wraps the runner: at each step's start and at each of its layer boundaries, the threads the lanes
    run on add up to at most the CPU's, and the calling lane runs on the share it published."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.real_run = engine, engine.runner.run
        self.checks = self.violations = 0
        self.lanes_seen: set[str] = set()
        engine.runner.run = self.run

    def check(self) -> None:
        share = self.engine._share
        assert share is not None
        lane = _lane_of_this_thread()
        with share.condition:
            total, mine = sum(share.running_on.values()), share.running_on.get(lane, 0)
        self.checks += 1
        if total > share.total or torch.get_num_threads() != mine:
            self.violations += 1

    def run(self, chunks, between_layers=None):
        self.lanes_seen.add(threading.current_thread().name)
        self.check()

        def hook():
            if between_layers is not None:
                between_layers()
            self.check()

        return self.real_run(chunks, hook)


@needs_two_threads
@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_rows_equal_one_piece_runs_with_two_lanes_busy(model, mode):
    """Records of mixed lengths sent together, and then in waves: both lanes run steps, every record's rows
    equal a one-piece run, the threads are never oversubscribed, and the pools are whole afterwards."""
    use_kernels(model, "reference")
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    records = [random_ids(vocab, rng.choice([rng.randint(1, 30), rng.randint(60, 5 * BUDGET)]), gen)
               for _ in range(24)]
    expected = [model.run_sequence(ids)[0] for ids in records]
    use_kernels(model, mode)
    try:
        config = small_config(max_num_seqs=4, prefill_chunk_size=BUDGET, block_size=8)
        engine = Engine(model, config, keep_hidden)
        audit = ThreadAudit(engine)
        with engine:
            assert len(engine.lanes) == 2
            engine.poison_free_memory()
            got = []
            for wave in (records[:12], records[12:]):
                with ThreadPoolExecutor(6) as pool:
                    futures = list(pool.map(engine.submit, wave))
                got += [f.result(timeout=120) for f in futures]
            stats = engine.stats()
    finally:
        use_kernels(model, "auto")
    for ids, want, rows in zip(records, expected, got, strict=True):
        assert rows.shape == (len(ids), model.config.hidden_size)
        test_device.assert_close(rows, want, TOLERANCE)
    assert stats["side_steps"] > 0 and audit.lanes_seen == {"engine", "engine-lane-1"}
    assert audit.checks > stats["steps"] and audit.violations == 0
    _pools_whole(stats)


@needs_two_threads
def test_records_sent_one_at_a_time_stay_on_the_first_lane_with_every_thread(model):
    gen = torch.Generator().manual_seed(4)
    with Engine(model, small_config(prefill_chunk_size=BUDGET), keep_hidden) as engine:
        threads = []
        real_run = engine.runner.run

        def run(chunks, between_layers=None):
            threads.append(torch.get_num_threads())
            return real_run(chunks, between_layers)

        engine.runner.run = run
        for n in (5, 3 * BUDGET + 7, 70):
            engine.submit(random_ids(model.config.vocab_size, n, gen)).result(timeout=60)
        stats = engine.stats()
    assert stats["side_steps"] == 0 and stats["steps"] >= 5
    assert set(threads) == {2}


@needs_two_threads
def test_a_failing_step_on_the_second_lane_fails_only_its_sequences(model):
    """Lane 0 holds a long record's step (passing layer boundaries) until lane 1 has run a step of the
    records sent meanwhile; that step fails: its records fail, lane 0's record answers, nothing leaks."""
    gen = torch.Generator().manual_seed(5)
    config = small_config(max_num_seqs=4, prefill_chunk_size=BUDGET, layer_preemption=False)
    engine = Engine(model, config, lambda fs: [f.payload for f in fs])
    real_run = engine.runner.run
    second_lane_ran = threading.Event()

    def run(chunks, between_layers=None):
        if threading.current_thread().name == "engine-lane-1":
            second_lane_ran.set()
            raise RuntimeError("injected")
        if any(seq.payload == "long" for seq, _ in chunks):
            deadline = time.monotonic() + 30
            while not second_lane_ran.is_set() and time.monotonic() < deadline:
                assert between_layers is not None
                between_layers()  # as at a layer boundary: lane 0 narrows, lane 1 may start
                time.sleep(0.002)
        return real_run(chunks, between_layers)

    engine.runner.run = run
    vocab = model.config.vocab_size
    with engine:
        long = engine.submit(random_ids(vocab, 2 * BUDGET, gen), payload="long")
        while not engine.lanes[0].in_flight:
            time.sleep(0.001)
        others = [engine.submit(random_ids(vocab, 10, gen), payload=p) for p in "ab"]
        for fut in others:
            with pytest.raises(RuntimeError, match="injected"):
                fut.result(timeout=30)
        assert long.result(timeout=30) == "long"
        assert engine.submit(random_ids(vocab, 7, gen), payload="after").result(timeout=30) == "after"
        stats = engine.stats()
    assert second_lane_ran.is_set() and stats["failed"] == 2
    _pools_whole(stats)


@needs_two_threads
def test_cancelling_under_load_returns_every_block_and_slot(model):
    """Records cancelled at random moments, waiting or in flight on either lane: each is counted once, and
    the pools come back whole."""
    rng = random.Random(6)
    gen = torch.Generator().manual_seed(6)
    vocab = model.config.vocab_size
    with Engine(model, small_config(max_num_seqs=4, prefill_chunk_size=BUDGET), lambda fs: [0] * len(fs)) \
            as engine:
        futures = []
        for _ in range(4):
            wave = [engine.submit(random_ids(vocab, rng.randint(1, 4 * BUDGET), gen)) for _ in range(16)]
            futures += wave
            for fut in rng.sample(wave, 6):
                time.sleep(rng.random() * 0.01)
                fut.cancel()
            for fut in wave:
                if not fut.cancelled():
                    assert fut.result(timeout=60) == 0
        stats = engine.stats()
    assert stats["cancelled"] == sum(f.cancelled() for f in futures) > 0
    assert stats["finished"] + stats["cancelled"] == len(futures)
    assert stats["side_steps"] > 0
    _pools_whole(stats)


@needs_two_threads
def test_idle_work_never_runs_beside_a_step(model):
    """Idle work (the live audit swaps the reference ops onto the backbone for a piece) runs only while no
    lane has a step in flight, and no lane starts one during a piece."""
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    with Engine(model, small_config(max_num_seqs=4, prefill_chunk_size=BUDGET), lambda fs: [0] * len(fs)) \
            as engine:
        active = {"steps": 0, "pieces": 0, "overlaps": 0}
        lock = threading.Lock()
        real_run = engine.runner.run

        def run(chunks, between_layers=None):
            with lock:
                active["steps"] += 1
                active["overlaps"] += active["pieces"]
            try:
                return real_run(chunks, between_layers)
            finally:
                with lock:
                    active["steps"] -= 1

        class Work:
            pieces = 0

            def pending(self):
                return self.pieces < 400

            def run_piece(self):
                with lock:
                    active["pieces"] += 1
                    active["overlaps"] += active["steps"]
                self.pieces += 1
                time.sleep(0.002)
                with lock:
                    active["pieces"] -= 1

        engine.runner.run = run
        work = Work()
        engine.set_idle_work(work)
        for _ in range(6):
            wave = [random_ids(vocab, n, gen) for n in (5, 90, 130, 9, 60, 150)]
            with ThreadPoolExecutor(6) as pool:
                futures = list(pool.map(engine.submit, wave))
            assert [f.result(timeout=60) for f in futures] == [0] * 6
            time.sleep(0.02)
        stats = engine.stats()
    assert work.pieces > 0 and stats["side_steps"] > 0
    assert active["overlaps"] == 0


@needs_two_threads
def test_a_step_of_short_records_runs_on_every_thread_while_the_other_lanes_long_step_holds(model):
    """Two long records run on the two lanes; a short record sent meanwhile runs in a step of its own, and the
    other lane's long step holds at its next layer boundary until that step ends, so the short step widens to
    every thread beside a long step still in flight. Every record's rows equal a one-piece run."""
    gen = torch.Generator().manual_seed(8)
    vocab = model.config.vocab_size
    longs = [random_ids(vocab, 5 * BUDGET + 7, gen) for _ in range(2)]
    short = random_ids(vocab, 20, gen)
    engine = Engine(model, small_config(max_num_seqs=4, prefill_chunk_size=BUDGET), keep_hidden)
    real_run = engine.runner.run
    beside_long: list[bool] = []  # at each boundary of the short step: all threads, the other lane's step on

    def run(chunks, between_layers=None):
        short_step = any(seq.payload == "short" for seq, _ in chunks)

        def hook():
            if between_layers is not None:
                between_layers()
            if short_step:
                other = engine.lanes[1 - _lane_of_this_thread()]
                beside_long.append(torch.get_num_threads() == 2 and bool(other.in_flight))
                time.sleep(0.02)  # long enough for the other lane to reach a layer boundary
            else:
                time.sleep(0.002)

        return real_run(chunks, hook)

    engine.runner.run = run
    with engine:
        first = engine.submit(longs[0], payload="long")
        while not engine.lanes[0].in_flight:
            time.sleep(0.001)
        second = engine.submit(longs[1], payload="long")
        deadline = time.monotonic() + 30
        while not all(lane.in_flight for lane in engine.lanes) and time.monotonic() < deadline:
            time.sleep(0.001)
        short_rows = engine.submit(short, payload="short").result(timeout=60)
        rows = [first.result(timeout=60), second.result(timeout=60)]
        stats = engine.stats()
    assert any(beside_long), beside_long
    assert stats["held_steps"] >= 1
    for ids, got in zip([*longs, short], [*rows, short_rows], strict=True):
        test_device.assert_close(got, model.run_sequence(ids)[0], TOLERANCE)
    _pools_whole(stats)


@needs_two_threads
def test_a_stream_of_short_records_slows_a_long_record_without_starving_it(model):
    """A held long step waits only for the steps of short records in flight when it reached its boundary:
    with short records sent back to back from four clients, the long record still answers long before the
    stream ends (it goes on by at least half a layer per step of short records: here at most ~70 such
    steps of at most four records each)."""
    gen = torch.Generator().manual_seed(9)
    vocab = model.config.vocab_size
    stream = [random_ids(vocab, 10, gen) for _ in range(1000)]
    answered = []
    with Engine(model, small_config(max_num_seqs=6, prefill_chunk_size=BUDGET), lambda fs: [0] * len(fs)) \
            as engine:
        long = engine.submit(random_ids(vocab, 5 * BUDGET + 7, gen))
        lock = threading.Lock()

        def client(records):
            for ids in records:
                if long.done():
                    return
                engine.submit(ids).result(timeout=60)
                with lock:
                    answered.append(1)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(client, [stream[i::4] for i in range(4)]))
        assert long.result(timeout=60) == 0
        stats = engine.stats()
    assert stats["held_steps"] >= 1
    assert len(answered) < len(stream) // 2
    _pools_whole(stats)

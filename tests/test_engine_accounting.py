"""Every block and slot comes back: after finishing, cancelling (waiting or running) and failing."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch

from clefserve.engine import Engine, StepError
from clefserve.model.weights import load_backbone
from tests.engine_support import ENGINE_SPECS, PausingFinish, random_ids, small_config


@pytest.fixture(scope="module")
def model(make_release):
    return load_backbone(make_release(ENGINE_SPECS["default"], seed=5))


def _all_free(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    # blocks the prefix cache holds are held by nothing else, and come back when it is cleared
    assert stats["kv_blocks_free"] + stats["prefix_blocks_cache_only"] == stats["kv_blocks_total"]
    assert stats["prefix_blocks_cache_only"] == stats["prefix_blocks"]
    assert stats["gdn_slots_free"] == stats["gdn_slots_total"]
    engine.clear_prefix_cache()
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["prefix_cache_bytes"] == 0


def _freeze_mid_way(engine: Engine, finish: PausingFinish, futures: list) -> tuple[list, list]:
    """Hold the engine between two steps at a moment when some sequences run and others wait."""
    for _ in range(50):
        finish.hold()
        finish.wait_held()
        stats = engine.stats()
        pending = [f for f in futures if not f.done() and not f.running()]
        # FIFO admission: the running ones are the oldest unresolved submissions
        running, waiting = pending[: stats["running"]], pending[stats["running"] :]
        if len(running) >= 2 and len(waiting) >= 3:
            return running, waiting
        finish.release()
    raise AssertionError("never saw running and waiting sequences at once")


def test_blocks_and_slots_return_after_finishing_and_cancelling(model):
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    finish = PausingFinish()
    # a pool of 60 blocks of 8 tokens: long records also wait for blocks, not only for slots
    # one lane: holding its finish holds the whole engine between two steps
    config = small_config(max_num_seqs=4, prefill_chunk_size=32, block_size=8, kv_cache_mb=None, cpu_lanes=1)
    block_bytes = 8 * 1 * 2 * 2 * 16 * 4
    engine = Engine(model, config, finish, memory_budget_bytes=int(60 * block_bytes / config.kv_fraction) + 1)
    assert engine.stats()["kv_blocks_total"] == 60
    futures = []
    cancelled_running = cancelled_waiting = 0
    with engine:
        for _ in range(5):
            # 40 submissions at once, then cancel 2 of them while they run and 3 while they wait
            for _ in range(40):
                n = rng.choice([rng.randint(1, 12), rng.randint(13, 200)])
                ids = random_ids(model.config.vocab_size, n, gen)
                futures.append(engine.submit(ids, payload=len(futures)))
            running, waiting = _freeze_mid_way(engine, finish, futures)
            try:
                cancelled_running += sum(engine.cancel(f) for f in running[:2])
                cancelled_waiting += sum(engine.cancel(f) for f in rng.sample(waiting, 3))
            finally:
                finish.release()
        for f in futures:
            if not f.cancelled():
                assert f.result(timeout=60) in range(200)
        stats = engine.stats()
        _all_free(engine)
    assert (cancelled_running, cancelled_waiting) == (10, 15)
    assert stats["cancelled_running"] == cancelled_running
    assert stats["cancelled_waiting"] == cancelled_waiting
    assert stats["cancelled"] + stats["finished"] == 200
    assert sum(f.cancelled() for f in futures) == stats["cancelled"]
    # a running sequence cancelled mid-way never reached finish
    finished_payloads = set(finish.order)
    assert not any(futures[i].cancelled() and i in finished_payloads for i in range(200))


def test_a_failing_step_fails_only_its_sequences(model):
    gen = torch.Generator().manual_seed(1)
    # without pausing, long records share a quarter of the step beside a short one: "a"'s last piece (8
    # tokens) then runs beside 4 of "boom"'s, and the step that fails holds both (on one lane: with two, the
    # second could take "boom" into a step of its own; tests/test_cpu_lanes.py fails a step there)
    config = small_config(max_num_seqs=2, prefill_chunk_size=16, layer_preemption=False, cpu_lanes=1)
    engine = Engine(model, config, lambda fs: [f.payload for f in fs])
    real_run = engine.runner.run
    boom_submitted = threading.Event()

    def run(chunks, between_layers=None):
        # "a" must not finish before "boom" is in: then their last pieces share a step (SRPT order)
        boom_submitted.wait(30)
        if any(seq.payload == "boom" for seq, _ in chunks):
            raise RuntimeError("injected")
        return real_run(chunks, between_layers)

    engine.runner.run = run
    with engine:
        ids = [random_ids(model.config.vocab_size, n, gen) for n in (40, 40, 40, 40)]
        good = engine.submit(ids[0], payload="a")
        bad = engine.submit(ids[1], payload="boom")
        boom_submitted.set()
        later = [engine.submit(x, payload=p) for x, p in zip(ids[2:], "cd", strict=True)]
        with pytest.raises(RuntimeError, match="injected"):
            bad.result(timeout=30)
        # "a" shared the failing step with "boom": it fails too (its state may be half-written)
        with pytest.raises(RuntimeError, match="injected"):
            good.result(timeout=30)
        assert [f.result(timeout=30) for f in later] == ["c", "d"]
        _all_free(engine)
        assert engine.stats()["failed"] == 2


def test_finish_errors_reach_only_their_futures(model):
    gen = torch.Generator().manual_seed(2)

    def finish(fs):
        if any(f.payload == "raise" for f in fs):
            raise ValueError("head failed")
        return [ValueError("bad record") if f.payload == "exc" else f.payload for f in fs]

    # one record per finish call (with a prefix cache the three repeats would be answered together)
    with Engine(model, small_config(max_num_seqs=1, prefix_cache=False), finish) as engine:
        ids = random_ids(model.config.vocab_size, 10, gen)
        futures = {p: engine.submit(ids, payload=p) for p in ("ok", "exc", "raise", "ok2")}
        assert futures["ok"].result(timeout=30) == "ok"
        with pytest.raises(ValueError, match="bad record"):
            futures["exc"].result(timeout=30)
        with pytest.raises(ValueError, match="head failed"):
            futures["raise"].result(timeout=30)
        assert futures["ok2"].result(timeout=30) == "ok2"
        _all_free(engine)


def test_finish_must_return_one_result_per_sequence(model):
    with Engine(model, small_config(), lambda fs: []) as engine:
        fut = engine.submit([1, 2, 3])
        with pytest.raises(StepError):
            fut.result(timeout=30)
        _all_free(engine)


def test_shutdown_fails_unfinished_and_refuses_new(model):
    from clefserve.engine import EngineClosedError

    finish = PausingFinish()
    engine = Engine(model, small_config(max_num_seqs=1), finish)
    finish.hold()
    first = engine.submit([1, 2, 3], payload=0)
    finish.wait_held()
    waiting = engine.submit([4, 5, 6], payload=1)
    stopper = threading.Thread(target=engine.shutdown)
    stopper.start()
    deadline = time.monotonic() + 10
    while not engine.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    finish.release()
    stopper.join(10)
    assert first.result(timeout=5) == 0
    with pytest.raises((EngineClosedError, CancelledError)):
        waiting.result(timeout=5)
    with pytest.raises(EngineClosedError):
        engine.submit([1])


def test_an_engine_bug_fails_the_sequences_in_flight_and_the_loop_survives(model):
    with Engine(model, small_config(), lambda fs: [f.payload for f in fs]) as engine:
        real_schedule = engine.scheduler.schedule
        broken = threading.Event()

        def schedule(*args):
            if not broken.is_set():
                broken.set()
                raise AssertionError("scheduler bug")
            return real_schedule(*args)

        engine.scheduler.schedule = schedule
        with pytest.raises(AssertionError, match="scheduler bug"):
            engine.submit([1, 2, 3], payload="first").result(timeout=30)
        assert engine.submit([4, 5], payload="second").result(timeout=30) == "second"
        _all_free(engine)
        assert not engine.closed

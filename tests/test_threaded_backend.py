"""ThreadedBackend: one worker thread, one request at a time, loading in the background."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from typing import Any

import pytest

from clefserve.errors import RequestError
from clefserve.server.threaded import ThreadedBackend


async def connected() -> bool:
    return False


async def disconnected() -> bool:
    return True


class SlowDecider:
    def __init__(self, seconds: float = 0.05) -> None:
        self.seconds = seconds
        self.running = 0
        self.max_running = 0
        self.threads: set[str] = set()
        self.order: list[Any] = []
        self.lock = threading.Lock()

    def decide_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        self.order.append(requests[0]["n"])
        with self.lock:
            self.running -= 1
        usage = {"input_tokens": 1, "output_tokens": 0}
        return [{"model": "m", "answers": {}, "usage": usage, "n": requests[0]["n"]}]


def test_one_at_a_time_in_arrival_order_on_one_worker_thread() -> None:
    decider = SlowDecider()
    backend = ThreadedBackend(decider, "clef")

    async def run() -> list[dict[str, Any]]:
        tasks = []
        for n in range(6):
            tasks.append(asyncio.create_task(backend.decide({"n": n}, f"r{n}", connected)))
            await asyncio.sleep(0)  # arrival order = creation order
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert [r["n"] for r in results] == list(range(6))
    assert decider.order == list(range(6))
    assert decider.max_running == 1
    assert len(decider.threads) == 1 and next(iter(decider.threads)).startswith("clef-decider")
    assert threading.main_thread().name not in decider.threads


def test_event_loop_stays_free_while_deciding() -> None:
    backend = ThreadedBackend(SlowDecider(seconds=0.5), "clef")

    async def run() -> float:
        task = asyncio.create_task(backend.decide({"n": 0}, "r", connected))
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        await asyncio.sleep(0.01)
        waited = time.perf_counter() - started
        await task
        return waited

    assert asyncio.run(run()) < 0.2


def test_disconnected_client_is_dropped_before_its_turn() -> None:
    decider = SlowDecider()
    backend = ThreadedBackend(decider, "clef")
    with pytest.raises(RequestError) as info:
        asyncio.run(backend.decide({"n": 0}, "r", disconnected))
    assert info.value.status == 499
    assert decider.order == []


def test_loading_in_the_background() -> None:
    release = threading.Event()

    def load() -> SlowDecider:
        release.wait(5)
        return SlowDecider(seconds=0)

    backend = ThreadedBackend.loading(load, "clef")
    assert backend.ready() == (False, "not started")

    async def run() -> None:
        await backend.start()
        assert backend.ready() == (False, "loading the model")
        with pytest.raises(RequestError) as info:
            await backend.decide({"n": 0}, "r", connected)
        assert info.value.status == 503 and "loading" in info.value.message
        release.set()
        for _ in range(100):
            if backend.ready()[0]:
                break
            await asyncio.sleep(0.02)
        assert backend.ready() == (True, "ready")
        assert (await backend.decide({"n": 1}, "r", connected))["n"] == 1
        await backend.stop()

    asyncio.run(run())


def test_failed_load_is_reported_by_ready() -> None:
    def load() -> SlowDecider:
        raise FileNotFoundError("joint_head.safetensors is missing")

    backend = ThreadedBackend.loading(load, "clef")

    async def run() -> None:
        await backend.start()
        for _ in range(100):
            if "failed" in backend.ready()[1]:
                break
            await asyncio.sleep(0.02)

    asyncio.run(run())
    ok, reason = backend.ready()
    assert not ok
    assert "FileNotFoundError" in reason and "joint_head.safetensors" in reason


def test_wrong_result_count_is_an_error() -> None:
    class Empty:
        def decide_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return []

    with pytest.raises(RuntimeError):
        asyncio.run(ThreadedBackend(Empty(), "clef").decide({}, "r", connected))


def test_model_card() -> None:
    backend = ThreadedBackend(SlowDecider(), "clef-flash", release_date=dt.date(2026, 9, 30))
    [card] = backend.model_cards()
    assert card["name"] == "clef-flash" and card["release_date"] == "2026-09-30" and card["description"]


def test_needs_exactly_one_of_decider_and_load() -> None:
    with pytest.raises(ValueError):
        ThreadedBackend(None, "clef")
    with pytest.raises(ValueError):
        ThreadedBackend(SlowDecider(), "clef", load=SlowDecider)

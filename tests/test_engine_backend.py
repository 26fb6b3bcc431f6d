"""EngineBackend: concurrent requests through the engine answer like sequential ones; disconnects cancel."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from clefserve.config import EngineConfig
from clefserve.errors import RequestError
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.canary import using_reference_ops
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.testing.release import ReleaseSpec
from tests.request_gen import RequestGenerator

MAX_LENGTH = 450


async def connected() -> bool:
    return False


def assert_same_answers(ours: Any, ref: Any, path: tuple = ()) -> None:
    """Equal, except that a rounded number may move one step (1e-4) when float noise crosses a boundary."""
    if isinstance(ref, dict):
        assert isinstance(ours, dict) and list(ours) == list(ref), path
        for key in ref:
            assert_same_answers(ours[key], ref[key], (*path, key))
    elif isinstance(ref, float) and not isinstance(ref, bool):
        assert isinstance(ours, float) and math.isclose(ours, ref, abs_tol=1.5e-4), (path, ours, ref)
    else:
        assert ours == ref, (path, ours, ref)


@pytest.fixture(scope="module")
def decider(make_release) -> ClefDecider:
    return ClefDecider(make_release(ReleaseSpec(), seed=21), max_length=MAX_LENGTH)


def _config(**overrides: Any) -> EngineConfig:
    values = dict(max_num_seqs=4, prefill_chunk_size=128, block_size=16, kv_cache_mb=8, max_queue=64,
                  max_length=MAX_LENGTH)
    values.update(overrides)
    return EngineConfig(**values)


def test_concurrent_requests_answer_like_sequential_ones(decider):
    generator = RequestGenerator(seed=4)
    bodies, sequential = [], []
    while len(bodies) < 40:
        body = generator.request(long_state=len(bodies) % 5 == 0, max_questions=3)
        try:
            sequential.append(decider.decide_batch([body])[0])
        except RequestError:  # a schema longer than MAX_LENGTH
            continue
        bodies.append(body)
    backend = EngineBackend(decider, _config(), "clef-test")

    async def run() -> list[dict[str, Any]]:
        await backend.start()
        try:
            calls = [backend.decide(body, f"r{i}", connected) for i, body in enumerate(bodies)]
            return await asyncio.gather(*calls)
        finally:
            await backend.stop()

    assert backend.ready() == (True, "ready")
    concurrent = asyncio.run(run())
    lengths = [r["usage"]["input_tokens"] for r in sequential]
    assert min(lengths) < 256 and max(lengths) > 3 * 128  # records of one chunk and of several
    for ours, ref in zip(concurrent, sequential, strict=True):
        cached = ours["usage"].pop("x_cached_tokens")  # the prefix cache's share of the record
        assert 0 <= cached <= ours["usage"]["input_tokens"]
        assert_same_answers(ours, ref)
    stats = backend.engine.stats()
    assert stats["prefix_hit_tokens"] > 0  # at least the fixed system prefix
    assert stats["finished"] == 40 and stats["multi_seq_steps"] > 0
    assert stats["kv_blocks_free"] + stats["prefix_blocks_cache_only"] == stats["kv_blocks_total"]
    assert not backend.ready()[0]


def test_a_disconnected_client_is_cancelled_and_frees_its_sequence(decider, monkeypatch):
    import clefserve.formats.clef.engine_backend as engine_backend

    # poll without waiting, so the second request is still queued behind the first when its client goes
    monkeypatch.setattr(engine_backend, "DISCONNECT_POLL_SECONDS", 0.0)
    generator = RequestGenerator(seed=5)
    backend = EngineBackend(decider, _config(max_num_seqs=1, prefill_chunk_size=16), "clef-test")
    polls = 0

    async def gone_after_first_poll() -> bool:
        nonlocal polls
        polls += 1
        return polls > 1

    async def run() -> None:
        # a long record ahead keeps the engine busy, so the second request is still waiting
        first, second = (generator.request(long_state=True, max_questions=1) for _ in range(2))
        blocker = asyncio.create_task(backend.decide(first, "a", connected))
        with pytest.raises(RequestError) as gone:
            await backend.decide(second, "b", gone_after_first_poll)
        assert (gone.value.status, gone.value.error_type) == (499, "cancelled")
        await blocker
        await backend.stop()

    asyncio.run(run())
    stats = backend.engine.stats()
    assert stats["cancelled"] == 1 and stats["finished"] == 1
    assert stats["kv_blocks_free"] + stats["prefix_blocks_cache_only"] == stats["kv_blocks_total"]
    assert stats["gdn_slots_free"] == stats["gdn_slots_total"]


def test_refusals_are_request_errors(decider):
    backend = EngineBackend(decider, _config(kv_cache_mb=None, max_queue=0), "clef-test",
                            memory_budget_bytes=64 << 20)

    async def run() -> None:
        with pytest.raises(RequestError) as full:
            await backend.decide(RequestGenerator(seed=6).request(max_questions=1), "r", connected)
        assert full.value.status == 429 and full.value.retry_after >= 1
        await backend.stop()
        with pytest.raises(RequestError) as stopped:
            await backend.decide(RequestGenerator(seed=6).request(max_questions=1), "r", connected)
        assert stopped.value.status == 503

    asyncio.run(run())


def _loading_backend(make_release, **config: Any) -> EngineBackend:
    """A backend that loads a release and runs the startup self-check (canaries need the default length)."""
    decider = ClefDecider(make_release(ReleaseSpec(), seed=21))
    return EngineBackend.loading(lambda: decider, _config(max_length=16384, kv_cache_mb=64, **config),
                                 "clef-test", self_check=True)


def test_ready_is_never_true_before_the_startup_self_check_has_passed(make_release, monkeypatch):
    """The engine exists before the check runs; /ready must not be 200 in between (it once was)."""
    seen: list[tuple[bool, str]] = []
    attach = EngineBackend._attach

    def attach_and_look(self: EngineBackend, loaded: ClefDecider) -> None:
        attach(self, loaded)
        seen.append(self.ready())

    monkeypatch.setattr(EngineBackend, "_attach", attach_and_look)
    backend = _loading_backend(make_release)
    try:
        backend._run_load()  # what start() runs on an executor thread
        assert seen == [(False, "running the startup self-check")]
        assert backend.ready() == (True, "ready")
    finally:
        assert backend.engine is not None
        backend.engine.shutdown()


def test_the_self_check_fits_the_smallest_queue(make_release):
    """The canaries go in together but within --max-queue: a server with a queue of 1 still starts."""
    backend = _loading_backend(make_release, max_num_seqs=1, max_queue=1)
    try:
        backend._run_load()
        assert backend.ready() == (True, "ready")
    finally:
        assert backend.engine is not None
        backend.engine.shutdown()


def test_threads_that_did_torch_work_let_their_openmp_team_go(decider, monkeypatch):
    """The loading thread (also when loading fails), a request's encoding thread and the thread that ran the
    self-check release their OpenMP team when done: an idle team beside the engine's made every op of a step
    wait on the kernel."""
    import threading

    from clefserve.formats.clef import engine_backend

    released: list[int] = []
    monkeypatch.setattr(engine_backend, "release_thread_team", lambda: released.append(threading.get_ident()))

    def fail() -> ClefDecider:
        raise RuntimeError("no weights")

    backend = EngineBackend.loading(fail, _config(), "clef-test")
    backend._run_load()
    assert released == [threading.get_ident()] and not backend.ready()[0]

    released.clear()
    body = RequestGenerator(seed=5).request(long_state=False, max_questions=2)
    record, _ = EngineBackend._prepare(decider, body)
    assert record.input_ids and released == [threading.get_ident()]

    released.clear()  # the self-check's reference path runs on the calling thread (an embedder's, Ray's)
    backend = EngineBackend(decider, _config(), "clef-test")
    try:
        assert backend.run_self_check() == []
        assert released == [threading.get_ident()]
    finally:
        assert backend.engine is not None
        backend.engine.shutdown()


def test_status_names_the_serving_ops_while_the_audit_borrows_the_reference_ones(decider):
    """The live audit and the self-check run the backbone on the reference ops for a while (in idle time, on
    the engine thread); /v1/status reports what serves requests all the same."""
    backend = EngineBackend(decider, _config(audit_fraction=1.0), "clef-test")
    try:
        serving = decider.backbone.ops.name
        assert backend.status()["ops"] == serving
        with using_reference_ops(decider.backbone):  # what an audit piece does
            assert decider.backbone.ops.name != serving
            assert backend.status()["ops"] == serving
    finally:
        backend.engine.shutdown()

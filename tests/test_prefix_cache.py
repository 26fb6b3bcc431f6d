"""The prefix cache: answers served from it equal cold answers; it stays within its byte budget; nothing
leaks; a prefix shared by requests in flight at once is computed once.

Cold answers come from one-piece ``Backbone.run_sequence`` runs (the engine-free reference) and the head.
"""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from clefserve.config import EngineConfig
from clefserve.engine import Engine
from clefserve.engine.memory import MIB
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.model.weights import load_backbone
from clefserve.testing.release import ReleaseSpec
from clefserve.testing.server_process import ServerProcess
from clefserve.testing.tokenizer import WORDS
from tests import device as test_device
from tests.engine_support import ENGINE_SPECS, PausingFinish, small_config

TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and lose a lot to a busy machine's other jobs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows(finished):
    return [(f.hidden.clone(), f.cached_tokens) for f in finished]


def _no_leaks(engine: Engine) -> None:
    """Idle: every block is free or held by the cache alone, every slot free; clearing frees all."""
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_blocks_free"] + stats["prefix_blocks_cache_only"] == stats["kv_blocks_total"]
    assert stats["prefix_blocks_cache_only"] == stats["prefix_blocks"]
    assert stats["gdn_slots_free"] == stats["gdn_slots_total"]
    assert stats["prefix_cache_bytes"] <= stats["prefix_cache_budget_bytes"]
    engine.clear_prefix_cache()
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["prefix_cache_bytes"] == 0 and stats["prefix_entries"] == stats["prefix_blocks"] == 0


# ---- Clef answers through the EngineBackend ----------------------------------------------------------

MAX_LENGTH = 640


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(low, high)))


def question(rng: random.Random) -> dict:
    kind = rng.choice(["noul", "choice", "score"])
    if kind == "noul":
        return {"type": "noul", "instructions": words(rng, 2, 6)}
    if kind == "choice":
        labels = rng.sample(WORDS, rng.randint(2, 4))
        return {"type": "choice", "instructions": words(rng, 2, 6),
                "criteria": {label: rng.choice([None, words(rng, 1, 3)]) for label in labels}}
    return {"type": "score", "instructions": words(rng, 2, 5),
            "criteria": [words(rng, 1, 2) for _ in range(rng.randint(2, 4))]}


def body(state: str, rng: random.Random) -> dict:
    return {"model": "clef", "state": state,
            "questions": {f"q{j}": question(rng) for j in range(rng.randint(1, 2))}}


def workload(seed: int) -> list[tuple[str, dict, str]]:
    """(kind, request, the group's first state) in submission order; every request after the first
    shares a prefix with an earlier one: the fixed prefix at least, the whole state for most."""
    rng = random.Random(seed)
    out: list[tuple[str, dict, str]] = []
    for _ in range(14):  # 14 groups of 8 requests
        state = words(rng, 20, 90)
        out.append(("other state", body(state, rng), state))
        for _ in range(4):
            out.append(("same state", body(state, rng), state))
        out.append(("identical", out[-1][1], state))
        longer = state + " " + words(rng, 1, 25)  # the state's tokens are a prefix of this one's
        out.append(("longer state", body(longer, rng), state))
        out.append(("identical", out[-1][1], state))
    return out


@pytest.fixture(scope="module")
def decider(make_release) -> ClefDecider:
    return ClefDecider(make_release(ReleaseSpec(), seed=21), test_device.dtype(), test_device.device(),
                       max_length=MAX_LENGTH)


@torch.inference_mode()
def cold_answer(decider: ClefDecider, request: dict) -> dict:
    record = decider.encode(request)
    hidden = decider.backbone.run_sequence(torch.tensor(record.input_ids))[0]
    return decider.answer(request, record, decider.logits([hidden], [record])[0], raw=True)


def assert_equal_answers(cached: dict, cold: dict) -> float:
    assert cached["answers"].keys() == cold["answers"].keys()
    allowed = test_device.tolerance(TOLERANCE)
    worst = 0.0
    for qid, want in cold["answers"].items():
        got = cached["answers"][qid]
        if got.get("choice") != want.get("choice"):  # only a tie within the tolerance may break the other way
            cold_p = want["x_probabilities"]
            assert cold_p[got["choice"]] >= cold_p[want["choice"]] - allowed, (qid, got, want)
        for option, p in want["x_probabilities"].items():
            worst = max(worst, abs(p - got["x_probabilities"][option]))
    assert worst <= allowed
    return worst


async def _never_gone() -> bool:
    return False


def test_cached_answers_equal_cold_answers(decider):
    requests = workload(seed=11)
    records = [decider.encode(r) for _, r, _ in requests]
    assert max(len(r.input_ids) for r in records) < MAX_LENGTH  # no state was cut
    cold = {}
    for (_, request, _), record in zip(requests, records, strict=True):
        if record.input_ids not in cold:
            cold[record.input_ids] = cold_answer(decider, request)
    config = EngineConfig(max_num_seqs=4, prefill_chunk_size=256, block_size=16, kv_cache_mb=8, max_queue=256,
                          max_length=MAX_LENGTH, raw_probabilities=True)
    backend = EngineBackend(decider, config, "clef-test")
    engine = backend.engine

    async def one_at_a_time() -> list[dict]:
        return [await backend.decide(r, f"a{i}", _never_gone) for i, (_, r, _) in enumerate(requests)]

    async def all_at_once() -> list[dict]:  # a fresh cache, everything in flight together
        engine.clear_prefix_cache()
        order = list(range(len(requests)))
        random.Random(3).shuffle(order)
        got = await asyncio.gather(*(backend.decide(requests[i][1], f"b{i}", _never_gone) for i in order))
        return [got[order.index(i)] for i in range(len(requests))]

    sequential = asyncio.run(one_at_a_time())
    stats = engine.stats()
    pairs = 0
    state_ends: dict[str, int] = {}  # state text -> state_end
    for (kind, request, first_state), record, answer in zip(requests, records, sequential, strict=True):
        assert_equal_answers(answer, cold[record.input_ids])
        cached = answer["usage"]["x_cached_tokens"]
        if kind == "identical":
            expected = len(record.input_ids)
        elif kind == "same state":  # a state too short for a resume point of its own is computed again
            expected = record.resume_points[-2]
        elif kind == "longer state":  # resumes where the shorter state ended
            expected = state_ends[first_state]
        else:
            expected = record.prefix_end if state_ends else 0
        assert cached == expected, (kind, cached, expected)
        pairs += cached > 0
        state_ends.setdefault(request["state"], record.resume_points[-2])
    assert pairs >= 100
    assert stats["prefix_hit_tokens"] == sum(a["usage"]["x_cached_tokens"] for a in sequential)
    total = sum(len(r.input_ids) for r in records)
    assert stats["prefix_computed_tokens"] == total - stats["prefix_hit_tokens"]

    together = asyncio.run(all_at_once())
    for record, answer in zip(records, together, strict=True):
        assert_equal_answers(answer, cold[record.input_ids])
    stats = engine.stats()
    assert stats["prefix_hits"] > len(requests) + 50  # the second round found shared prefixes too
    asyncio.run(backend.stop())
    _no_leaks(engine)


def test_a_real_server_reports_cached_tokens_and_answers_like_cold(make_release, decider, tmp_path):
    """On by default in ``clef-serve``: usage.x_cached_tokens, and the same raw probabilities as cold."""
    requests = [r for _, r, _ in workload(seed=12)[:24]]
    flags = ["--max-num-seqs", "4", "--prefill-chunk-size", "128", "--block-size", "16",
             "--kv-cache-mb", "16", "--x-raw-probabilities"]
    cold = [cold_answer(decider, r) for r in requests]
    release = make_release(ReleaseSpec(), seed=21)
    with ServerProcess(release, tmp_path / "server.log", *flags) as server, \
            httpx.Client(base_url=server.url, timeout=300) as client:

        def ask(request: dict) -> dict:
            response = client.post("/v1/systemone", json=request)
            assert response.status_code == 200, response.text
            return response.json()

        one_by_one = [ask(r) for r in requests]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(ask, requests))
    assert "prefix cache: 512 MiB budget" in (tmp_path / "server.log").read_text()
    # the startup self-check's canaries already put the fixed system prefix in the cache
    assert one_by_one[0]["usage"]["x_cached_tokens"] == decider.encode(requests[0]).prefix_end
    assert all(a["usage"]["x_cached_tokens"] > 0 for a in one_by_one[1:])
    assert all(a["usage"]["x_cached_tokens"] == a["usage"]["input_tokens"] for a in together)
    for answer, want in zip(one_by_one + together, cold + cold, strict=True):
        assert_equal_answers(answer, want)


# ---- the engine: hidden rows, snapshot points, eviction, accounting ----------------------------------


@pytest.fixture(scope="module")
def model(make_release):
    folder = make_release(ENGINE_SPECS["two-attn"], seed=3)
    return load_backbone(folder, test_device.dtype(), test_device.device())


@torch.inference_mode()
def _cold(model, ids: torch.Tensor) -> torch.Tensor:
    return model.run_sequence(ids)[0]


def _close(rows: torch.Tensor, cold: torch.Tensor) -> bool:
    return (rows - cold).float().abs().max().item() <= test_device.limit(cold, TOLERANCE)


def test_snapshots_are_taken_exactly_at_the_points_and_resume_anywhere_in_a_block(model):
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, vocab, (70,), generator=gen)
    config = small_config(max_num_seqs=2, prefill_chunk_size=48, block_size=5)  # points cut blocks
    with Engine(model, config, _rows) as engine:
        engine.poison_free_memory()
        first = engine.submit(base, snapshot_points=(13, 37, 40))
        rows, cached = first.result(timeout=60)
        assert cached == 0 and _close(rows, _cold(model, base))
        # a point inside a piece is snapshotted from the state kept there (13, then 40); the next point
        # inside the same piece ends it (37), the record's end ends the last (70)
        assert [n for step in engine.recent_steps() for _, n in step] == [37, 33]
        assert engine.stats()["prefix_entries"] == 4  # 13, 37, 40 and the end, 70
        for cut, want in [(12, 0), (13, 13), (36, 13), (37, 37), (39, 37), (45, 40), (70, 70)]:
            ids = torch.cat([base[:cut], torch.randint(0, vocab, (9,), generator=gen)])
            if cut < 70:
                ids[cut] = (base[cut] + 1) % vocab  # differs from the base right after the cut
            engine.poison_free_memory()
            rows, cached = engine.submit(ids).result(timeout=60)
            assert cached == want, (cut, cached)
            assert _close(rows, _cold(model, ids)), cut
        rows, cached = engine.submit(base).result(timeout=60)  # identical: served whole, nothing run
        assert cached == 70 and _close(rows, _cold(model, base))
        _no_leaks(engine)


def test_a_small_budget_evicts_and_stays_correct_and_bounded(model):
    """A budget for a handful of snapshots and a KV pool smaller than the workload's distinct prefixes:
    the cache evicts (for its budget and to admit sequences) and every answer still equals the cold one."""
    vocab = model.config.vocab_size
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, vocab, (rng.randint(10, 60),), generator=gen) for _ in range(4)]
    probe = Engine(model, small_config(), _rows)
    state_bytes = probe.prefix_cache.state_bytes
    probe.shutdown()
    budget_mb = (8 * state_bytes + 40_000) / MIB  # a few snapshots with their blocks and hidden rows
    block_bytes = 5 * 2 * 2 * 1 * 32 * model.embed_tokens.weight.element_size()  # K and V in the model dtype
    config = small_config(max_num_seqs=3, prefill_chunk_size=32, block_size=5, kv_cache_mb=None,
                          kv_fraction=0.125, prefix_cache_mb=budget_mb)
    # an eighth of the memory is the KV pool's 60 blocks; the rest leaves room for the cache's budget (the
    # snapshots' fp32 recurrent state does not shrink with the model dtype, the blocks do)
    with Engine(model, config, _rows, memory_budget_bytes=8 * 60 * block_bytes + 3) as engine:
        assert engine.stats()["kv_blocks_total"] == 60
        budget = engine.stats()["prefix_cache_budget_bytes"]
        assert abs(budget - budget_mb * MIB) <= 1
        worst = 0.0
        for round_ in range(30):
            batch = []
            for _ in range(rng.choice([1, 1, 3, 5])):
                doc = rng.choice(docs)
                ids = torch.cat([doc, torch.randint(0, vocab, (rng.randint(1, 40),), generator=gen)])
                if rng.random() < 0.2 and batch:
                    ids = batch[-1][0]  # identical to one in flight
                batch.append((ids, (len(doc), rng.randint(1, len(ids)))))
            with ThreadPoolExecutor(len(batch)) as pool:
                futures = list(pool.map(lambda b: engine.submit(b[0], snapshot_points=b[1]), batch))
            for (ids, _), fut in zip(batch, futures, strict=True):
                rows, _ = fut.result(timeout=60)
                cold = _cold(model, ids)
                worst = max(worst, (rows - cold).float().abs().max().item() / test_device.limit(cold, 1.0))
                stats = engine.stats()
                assert stats["prefix_cache_bytes"] <= budget
            if round_ % 4 == 3:
                engine.poison_free_memory()
        assert worst <= TOLERANCE if test_device.dtype() == torch.float32 else worst <= 1.0
        stats = engine.stats()
        assert stats["prefix_evictions"] > 10 and stats["prefix_hits"] > 10
        _no_leaks(engine)


def test_cancelled_and_failed_sequences_leak_nothing(model):
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    doc = torch.randint(0, vocab, (42,), generator=gen)  # cached up to 42: cuts a block of 5
    finish = PausingFinish(_rows)
    config = small_config(max_num_seqs=2, prefill_chunk_size=8, block_size=5)
    with Engine(model, config, finish) as engine:
        engine.submit(doc).result(timeout=60)  # cached: resumed below from position 40
        finish.hold()
        blocker = engine.submit(torch.randint(0, vocab, (3,), generator=gen))
        finish.wait_held()
        tails = [torch.cat([doc, torch.randint(0, vocab, (30,), generator=gen)]) for _ in range(6)]
        futures = [engine.submit(ids, snapshot_points=(45,)) for ids in tails]
        finish.release()
        blocker.result(timeout=60)
        for _ in range(200):  # cancel two once they run (resumed: they share the cached blocks)
            if engine.stats()["running"] >= 2:
                break
            threading.Event().wait(0.005)
        cancelled = [f for f in futures[:2] if engine.cancel(f)]
        cancelled += [f for f in futures[4:] if engine.cancel(f)]  # waiting
        for ids, fut in zip(tails, futures, strict=True):
            if not fut.cancelled():
                rows, cached = fut.result(timeout=60)
                assert cached == 42 and _close(rows, _cold(model, ids))
        assert cancelled
        _no_leaks(engine)


def test_a_snapshot_that_cannot_be_taken_costs_only_the_entry(model, caplog):
    class OutOfMemory:
        def __getitem__(self, _):
            raise RuntimeError("out of memory")

    ids = torch.randint(0, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(5))
    with Engine(model, small_config(block_size=5), _rows) as engine:
        cache = engine.prefix_cache
        states, kv = cache.states, cache.kv
        # 17 falls inside the one 30-token piece (its state kept in the step; the copy of its cut block's
        # K/V fails), 30 at its end (the copy of the slot's state fails)
        cache.states = type("Broken", (), {"conv": OutOfMemory(), "recurrent": None})()
        cache.kv = type("Broken", (), {"k": OutOfMemory(), "v": None})()
        rows, cached = engine.submit(ids, snapshot_points=(17,)).result(timeout=60)
        assert cached == 0 and _close(rows, _cold(model, ids))
        assert [n for step in engine.recent_steps() for _, n in step] == [30]
        stats = engine.stats()
        assert stats["prefix_entries"] == stats["prefix_blocks"] == 0  # the nodes made first are gone
        assert caplog.text.count("no snapshot of sequence") == 2
        cache.states, cache.kv = states, kv
        _no_leaks(engine)


@pytest.mark.parametrize("share", ["identical", "same state"])
def test_a_prefix_in_flight_is_computed_once(model, share):
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    state = torch.randint(0, vocab, (150,), generator=gen)
    a = torch.cat([state, torch.randint(0, vocab, (20,), generator=gen)])
    other = torch.cat([state, torch.randint(0, vocab, (25,), generator=gen)])
    b = a.clone() if share == "identical" else other
    finish = PausingFinish(_rows)
    config = small_config(max_num_seqs=4, prefill_chunk_size=32, block_size=8)
    with Engine(model, config, finish) as engine:
        finish.hold()
        blocker = engine.submit([1, 2, 3])
        finish.wait_held()  # both are queued before either is admitted: submitted "at the same time"
        fa, fb = (engine.submit(ids, snapshot_points=(150,)) for ids in (a, b))
        finish.release()
        blocker.result(timeout=60)
        (rows_a, cached_a), (rows_b, cached_b) = fa.result(timeout=60), fb.result(timeout=60)
        stats = engine.stats()
    assert _close(rows_a, _cold(model, a))
    assert _close(rows_b, _cold(model, b))
    assert cached_a == 0 and cached_b == (len(b) if share == "identical" else 150)
    assert stats["prefix_hit_tokens"] == cached_b
    assert stats["prefix_computed_tokens"] == 3 + len(a) + len(b) - cached_b


def test_no_prefix_cache_computes_everything(model):
    from clefserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--w", "x", "--no-prefix-cache", "--prefix-cache-mb", "7"])
    assert not EngineConfig.from_args(args).prefix_cache and EngineConfig.from_args(args).prefix_cache_mb == 7
    assert EngineConfig().prefix_cache  # on by default
    ids = torch.randint(0, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    with Engine(model, small_config(prefix_cache=False), _rows) as engine:
        for _ in range(2):
            rows, cached = engine.submit(ids, snapshot_points=(10,)).result(timeout=60)
            assert cached == 0 and _close(rows, _cold(model, ids))
        stats = engine.stats()
    assert not stats["prefix_cache"] and stats["prefix_hit_tokens"] == 0
    assert stats["prefix_computed_tokens"] == 60 and stats["prefix_cache_bytes"] == 0
    assert [n for step in engine.recent_steps() for _, n in step] == [30, 30]  # no split without a cache


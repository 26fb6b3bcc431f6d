"""Pictures in the engine: rows equal one-piece runs however records are chunked and batched (chunks cut
through pictures), and the prefix cache tells pictures apart by content, never by their token ids."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient

from clefserve.config import EngineConfig
from clefserve.engine import Engine
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.server import create_app
from clefserve.testing.release import ReleaseSpec, VisionSpec
from tests.engine_support import small_config
from tests.image_samples import as_data_url, file_bytes, picture

TOLERANCE = 1e-5
SPEC = ReleaseSpec(head_dim=32, partial_rotary_factor=0.5, vision=VisionSpec())
QUESTIONS = {
    "damaged": {"type": "noul", "instructions": "Is the parcel in the photo damaged?"},
    "kind": {"type": "choice", "instructions": "What is in the photo?",
             "criteria": {"parcel": "A parcel", "shoe": "A shoe", "other": None}},
}


@pytest.fixture(scope="module")
def decider(make_release) -> ClefDecider:
    return ClefDecider(make_release(SPEC, seed=9), max_length=1024)


def photo(seed: int, size: tuple[int, int] = (120, 90), fmt: str = "PNG") -> str:
    return as_data_url(file_bytes(picture(*size, seed=seed), fmt), fmt)


def mixed_bodies(rng: random.Random) -> list[dict]:
    bodies = []
    for i in range(8):
        count = rng.choice([0, 1, 1, 2, 3])
        sizes = [(rng.randint(20, 160), rng.randint(20, 160)) for _ in range(count)]
        images = [photo(rng.randrange(50), size) for size in sizes]
        note = rng.choices(["late", "broken", "box", "refund", "shoe"], k=rng.randint(2, 40))
        state = {"note": " ".join(note), "i": i}
        bodies.append({"model": "m", "state": state, "questions": QUESTIONS,
                       **({"images": images} if images else {})})
    return bodies


def cut_through_pictures(steps, records_by_seq) -> int:
    """Chunk boundaries that fall strictly inside a picture's span."""
    done: dict[int, int] = {}
    cuts = 0
    for step in steps:
        for seq, n in step:
            start = done.get(seq, 0)
            done[seq] = start + n
            record = records_by_seq.get(seq)
            if record is not None:
                cuts += sum(s.span.start < start + n < s.span.end for s in record.images)
    return cuts


@torch.inference_mode()
def test_engine_rows_with_pictures_equal_one_piece_runs(decider):
    rng = random.Random(0)
    bodies = mixed_bodies(rng)
    records = [decider.encode(b) for b in bodies]
    inputs = [decider.inputs(r) for r in records]
    assert sum(bool(r.images) for r in records) >= 5
    expected = [decider.backbone.run_sequence(torch.tensor(r.input_ids), inputs=i)[0]
                for r, i in zip(records, inputs, strict=True)]

    def finish(fs):
        return [(f.seq_id, f.hidden.clone()) for f in fs]

    # one lane, so that records share steps rather than run beside them (tests/test_cpu_lanes.py)
    config = small_config(max_num_seqs=3, prefill_chunk_size=23, block_size=5, kv_cache_mb=8,
                          prefix_cache=False, cpu_lanes=1)
    with Engine(decider.backbone, config, finish) as engine:
        for rounds in range(2):
            engine.poison_free_memory()
            order = list(range(len(records)))
            random.Random(rounds).shuffle(order)
            def submit(k: int):
                return engine.submit(records[k].input_ids, inputs=inputs[k])

            if rounds == 0:  # queued from the engine's thread: its next plan sees them all
                futures = engine.on_engine_thread(lambda: [submit(k) for k in order])  # noqa: B023
            else:  # submitting threads racing the engine
                with ThreadPoolExecutor(4) as pool:
                    futures = list(pool.map(submit, order))
            results = [f.result(timeout=120) for f in futures]
            by_seq = {}
            for k, (seq_id, got) in zip(order, results, strict=True):
                assert torch.isfinite(got).all()
                assert (got - expected[k]).abs().max().item() <= TOLERANCE, k
                by_seq[seq_id] = records[k]
            assert cut_through_pictures(engine.recent_steps(), by_seq) >= 3
        assert engine.stats()["multi_seq_steps"] > 0


async def _never_gone() -> bool:
    return False


@torch.inference_mode()
def cold(decider: ClefDecider, body: dict) -> dict:
    record = decider.encode(body)
    hidden = decider.backbone.run_sequence(torch.tensor(record.input_ids),
                                           inputs=decider.inputs(record, fresh=True))[0]
    return decider.answer(body, record, decider.logits([hidden], [record])[0], raw=True)


def assert_same(got: dict, want: dict) -> None:
    for qid, answer in want["answers"].items():
        assert got["answers"][qid].get("choice") == answer.get("choice")
        for option, p in answer["x_probabilities"].items():
            assert abs(got["answers"][qid]["x_probabilities"][option] - p) <= TOLERANCE, (qid, option)


def test_prefix_cache_tells_pictures_of_one_size_apart(decider):
    state = {"message": "The parcel arrived like this, see the photo. " * 6}
    a, b = photo(1), photo(2)
    first = {"model": "m", "state": state, "questions": QUESTIONS, "images": [a]}
    second = {**first, "images": [b]}
    assert decider.encode(first).input_ids == decider.encode(second).input_ids  # same ids, other pixels
    other_questions = {**first, "questions": {"urgent": {"type": "noul", "instructions": "Urgent?"}}}
    want = {"a": cold(decider, first), "b": cold(decider, second), "c": cold(decider, other_questions)}
    assert abs(want["a"]["answers"]["damaged"]["x_probabilities"]["true"]
               - want["b"]["answers"]["damaged"]["x_probabilities"]["true"]) > 1e-4  # the picture matters
    # the live audit off: a sampled request's audit runs the vision tower afresh in idle time, which would
    # move the counts below whenever the coin (1% by default) picks one
    config = EngineConfig(max_num_seqs=2, prefill_chunk_size=64, block_size=8, kv_cache_mb=16,
                          max_length=1024, raw_probabilities=True, audit_fraction=0.0)
    backend = EngineBackend(decider, config, "m")
    engine = backend.engine
    assert engine is not None
    record = decider.encode(first)
    before = backend.stats()
    assert before is not None
    for order in (("a", "b"), ("b", "a")):
        engine.clear_prefix_cache()

        async def run(order=order) -> list[dict]:
            bodies = {"a": first, "b": second}
            return [await backend.decide(bodies[k], k, _never_gone) for k in (*order, order[0])]

        answers = asyncio.run(run())
        for key, answer in zip((*order, order[0]), answers, strict=True):
            assert_same(answer, want[key])
        # the other picture shared the fixed prefix only; the same picture again is a whole-record hit
        assert answers[1]["usage"]["x_cached_tokens"] == record.prefix_end
        assert answers[2]["usage"]["x_cached_tokens"] == len(record.input_ids) > record.media_end
    # the same picture with other questions resumes after the state: through the picture
    encoded_before = backend.stats()["images_encoded"]
    answer = asyncio.run(backend.decide(other_questions, "c", _never_gone))
    assert_same(answer, want["c"])
    assert answer["usage"]["x_cached_tokens"] == record.state_end
    stats = backend.stats()
    assert stats is not None and stats["images_encoded"] == encoded_before  # an encoder cache hit
    # pictures are encoded when their sequence is admitted, unless the prefix cache covers them: a and b
    # once each (misses), then again after each clear of the prefix cache (hits); never for the whole-record
    # hits, nor for the other questions (resumed after the state, past the picture)
    assert stats["encoder_cache_misses"] - before["encoder_cache_misses"] == 2
    assert stats["encoder_cache_hits"] - before["encoder_cache_hits"] == 2
    with TestClient(create_app(backend, config)) as client:
        metrics = client.get("/metrics").text
    name = "clef_vision_encoder_cache_hits_total"
    hits = next(line for line in metrics.splitlines() if line.startswith(name))
    assert float(hits.split()[-1]) == stats["encoder_cache_hits"]
    asyncio.run(backend.stop())


def test_encoder_cache_is_bounded_in_bytes(make_release):
    decider = ClefDecider(make_release(SPEC, seed=9), max_length=1024, image_cache_bytes=10_000)
    assert decider.images is not None
    cache = decider.images.encoder.cache
    assert cache is not None
    bodies = [{"model": "m", "state": "s", "questions": QUESTIONS, "images": [photo(i, (200, 150))]}
              for i in range(6)]
    for body in bodies:
        decider.inputs(decider.encode(body))
    stats = cache.stats()
    assert 0 < stats["encoder_cache_bytes"] <= 10_000
    assert stats["encoder_cache_evictions"] >= 1

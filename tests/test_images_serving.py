"""Pictures through every way in besides ``POST /v1/systemone``: the live audit re-runs an audited request
with its pictures (so a wrong vision path is caught), the Workers AI routes take them in Cloudflare's
envelope, ``clef-serve batch`` answers a JSONL record with pictures as the HTTP route does (or gives a
per-record error), and ``/v1/status`` shows image support and the vision tower's counters."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from clefserve.config import EngineConfig
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.server import create_app
from clefserve.server.status import StatusResponse
from clefserve.testing.batch_workload import MAX_BODY_BYTES
from clefserve.testing.release import ReleaseSpec, VisionSpec
from tests.batch_support import RAW_TOLERANCE, read_output, run_batch
from tests.engine_support import audits_concluded
from tests.image_samples import as_base64, as_data_url, file_bytes, picture

SPEC = ReleaseSpec(head_dim=32, partial_rotary_factor=0.5, vision=VisionSpec())
SEED = 17
QUESTIONS = {"damaged": {"type": "noul", "instructions": "Is the parcel damaged?"},
             "kind": {"type": "choice", "criteria": {"parcel": None, "receipt": "A receipt"}}}


def request(images: list[str], note: str = "the parcel arrived", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "state": {"note": note}, "questions": QUESTIONS, "images": images, **extra}


def photo(seed: int, width: int = 96, height: int = 64, fmt: str = "PNG") -> str:
    return as_data_url(file_bytes(picture(width, height, seed=seed), fmt), fmt)


def config(**overrides: Any) -> EngineConfig:
    """The live audit is off unless a test turns it on: an audit runs the vision tower afresh in idle time,
    so with the default 1% sampling the vision counters could move between two reads of them."""
    values = dict(max_num_seqs=2, prefill_chunk_size=64, block_size=16, kv_cache_mb=8, max_length=1024,
                  raw_probabilities=True, audit_fraction=0.0)
    values.update(overrides)
    return EngineConfig(**values)


@pytest.fixture(scope="module")
def release(make_release) -> Path:
    return make_release(SPEC, seed=SEED)


async def _connected() -> bool:
    return False


def test_the_audit_reruns_requests_with_their_pictures(release: Path) -> None:
    """Every request audited (--audit-fraction 1): sound pictures match the reference path; a picture whose
    encoder-cache rows are wrong (served from the cache) is a mismatch, because the audit runs the vision
    tower afresh."""
    decider = ClefDecider(release, max_length=1024)
    backend = EngineBackend(decider, config(audit_fraction=1.0), "clef-vision")
    assert decider.images is not None and decider.images.encoder.cache is not None
    try:
        async def run() -> dict[str, Any]:
            for i in range(2):
                body = request([photo(i), photo(10 + i, 48, 80, "JPEG")], f"note {i}")
                await backend.decide(body, f"ok-{i}", _connected)
            return await audits_concluded(backend, 2)

        encoded_before = backend.stats()["images_encoded"]
        stats = asyncio.run(run())
        assert (stats["match"], stats["mismatch"], stats["skipped"]) == (2, 0, 0), stats
        # 4 pictures served, then 4 encoded again by the audit (never from the encoder cache)
        assert backend.stats()["images_encoded"] - encoded_before == 8
        assert stats["max_difference"]["sum"] <= 2e-4

        stale = decider.encode(request([photo(99)]))
        rows = decider.images.embed(stale.prepared_images, use_cache=False)[0]
        decider.images.encoder.cache.put(stale.prepared_images[0].digest, torch.roll(rows, 1, dims=0))

        async def run_stale() -> dict[str, Any]:
            await backend.decide(request([photo(99)], "stale rows"), "stale", _connected)
            return await audits_concluded(backend, 3)

        stats = asyncio.run(run_stale())
        assert stats["mismatch"] == 1 and stats["last_mismatch"]["request_id"] == "stale", stats
    finally:
        assert backend.engine is not None
        backend.engine.shutdown()


@pytest.fixture(scope="module")
def client(release: Path):
    settings = config()
    backend = EngineBackend(ClefDecider(release, max_length=1024), settings, "clef-vision")
    with TestClient(create_app(backend, settings)) as test_client:
        yield test_client


def _without_cached(answer: dict[str, Any]) -> dict[str, Any]:
    return {**answer, "usage": {k: v for k, v in answer["usage"].items() if k != "x_cached_tokens"}}


def test_workers_ai_routes_take_up_to_four_pictures(client: TestClient) -> None:
    body = request([photo(1), photo(2), photo(3), photo(4)])
    direct = client.post("/v1/systemone", json=body)
    assert direct.status_code == 200, direct.text
    for path in ("/ai/run/@cf/cloudflare/clef", "/client/v4/accounts/abc/ai/run/@cf/cloudflare/clef-flash"):
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        envelope = response.json()
        assert envelope["success"] is True and envelope["errors"] == []
        result = envelope["result"]
        assert result["model"] == "@cf/cloudflare/" + path.rsplit("/", 1)[1]
        assert _without_cached(result) == _without_cached({**direct.json(), "model": result["model"]})
    # a fifth picture, a URL, and a picture that is no picture: 400 in the envelope, naming the field
    for images, needle in (([photo(i) for i in range(5)], "images"),
                           ([photo(1), "https://example.com/a.png"], "images[1]"),
                           ([as_base64(b"GIF89a but not really")], "images[0]")):
        response = client.post("/ai/run/@cf/cloudflare/clef", json=request(images))
        assert response.status_code == 400, response.text
        envelope = response.json()
        assert envelope["success"] is False and envelope["result"] is None
        assert envelope["errors"][0]["code"] == 5006 and needle in envelope["errors"][0]["message"], envelope


def test_status_shows_image_support_and_the_vision_counters(client: TestClient) -> None:
    # the second picture again after another first one: past the prefix cache, from the encoder cache
    assert client.post("/v1/systemone", json=request([photo(8), photo(7)])).status_code == 200
    assert client.post("/v1/systemone", json=request([photo(9), photo(7)])).status_code == 200
    status = client.get("/v1/status").json()
    StatusResponse.model_validate(status)
    settings = config()
    assert status["images"] == {"supported": True, "max_images": 4,
                                "max_image_bytes": settings.max_image_bytes,
                                "max_image_pixels": settings.max_image_pixels,
                                "max_body_bytes": settings.max_body_bytes + settings.image_body_bytes}
    samples = {s.name: s.value for family in text_string_to_metric_families(client.get("/metrics").text)
               for s in family.samples}
    vision = status["engine"]["vision"]
    assert vision["images_encoded"] == samples["clef_vision_images_encoded_total"] >= 1
    assert vision["patches_encoded"] == samples["clef_vision_patches_encoded_total"]
    cache = vision["encoder_cache"]
    assert cache["hits"] == samples["clef_vision_encoder_cache_hits_total"] >= 1
    assert cache["misses"] == samples["clef_vision_encoder_cache_misses_total"]
    assert cache["budget_bytes"] == samples["clef_vision_encoder_cache_budget_bytes"] == 256 << 20
    assert cache["hit_rate"] == pytest.approx(cache["hits"] / (cache["hits"] + cache["misses"]), abs=1e-4)


def test_status_of_a_release_without_a_vision_tower_says_why(make_release) -> None:
    settings = config()
    backend = EngineBackend(ClefDecider(make_release(seed=SEED), max_length=1024), settings, "clef-text")
    with TestClient(create_app(backend, settings)) as test_client:
        status = test_client.get("/v1/status").json()
    StatusResponse.model_validate(status)
    assert status["images"]["supported"] is False and "vision" in status["images"]["reason"]
    assert status["engine"]["vision"] is None


def test_batch_answers_a_jsonl_record_with_pictures_as_the_route_does(release: Path, client: TestClient,
                                                                     tmp_path: Path) -> None:
    """ENGINE_FLAGS' --max-body-bytes is 6,000: the picture makes the good line longer than that, and the
    images' allowance lets it through, while a line whose text alone passes it is a 413."""
    good = request([photo(5, 160, 120)], "batch parcel", id="good")
    lines = [
        good,
        request([photo(1), "https://example.com/a.png"], id="url"),
        request([photo(2)], "x" * (MAX_BODY_BYTES + 1000), id="long-text"),
        request([as_base64(b"not a picture at all")], id="junk"),
    ]
    encoded = [json.dumps(line).encode() for line in lines]
    assert len(encoded[0]) > MAX_BODY_BYTES
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(line + b"\n" for line in encoded))
    output = tmp_path / "out.jsonl"
    result = run_batch(source, output, release)
    assert result.returncode == 0, result.stderr[-3000:]
    out = {line["id"]: line for line in read_output(output)}
    # a line over --max-body-bytes without its images is refused as unread: its line number is its id
    assert set(out) == {"good", "url", 3, "junk"}
    # the route's answer for the same body (the route takes the same flags here: x_probabilities on)
    route = client.post("/v1/systemone", json={k: v for k, v in good.items() if k != "id"})
    assert route.status_code == 200
    ours, theirs = out["good"], route.json()
    assert ours["usage"]["input_tokens"] == theirs["usage"]["input_tokens"]
    for qid, answer in theirs["answers"].items():
        for option, p in answer["x_probabilities"].items():
            assert abs(ours["answers"][qid]["x_probabilities"][option] - p) <= RAW_TOLERANCE
    assert out["url"]["error"]["status"] == 422 and "images[1]" in out["url"]["error"]["message"]
    assert out["junk"]["error"]["status"] == 422 and "images[0]" in out["junk"]["error"]["message"]
    long_text = out[3]["error"]
    assert long_text["status"] == 413 and "not counting the images" in long_text["message"], long_text

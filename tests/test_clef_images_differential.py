"""Requests with pictures, end to end through the serving engine, against Cloudflare's reference
``systemone`` with transformers' Qwen3VL processor (built without torchvision; tests/oracles.py).

Two release shapes with vision towers; 1 to 4 pictures per request of assorted formats (PNG, JPEG, WebP,
GIF, BMP), modes (RGB, L, RGBA, palette, CMYK), sizes (tiny, odd, above max_pixels) and an EXIF-rotated
JPEG, as raw base64 (with and without line breaks) and as data URLs. The engine runs with a small chunk
size (pieces cut through the pictures' spans), several sequences per step and the prefix cache on.
Required: identical token counts, probabilities within 2e-4 (fp32), identical decisions.
"""

from __future__ import annotations

import json
import random

import pytest

from clefserve.engine.errors import QueueFullError
from clefserve.errors import RequestError
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.testing.release import ReleaseSpec, VisionSpec
from tests.compare import assert_same_response
from tests.engine_support import small_config
from tests.image_samples import as_base64, as_data_url, assorted
from tests.oracles import jsm, reference_clef
from tests.request_gen import RequestGenerator

L, F = "linear_attention", "full_attention"
CASES = {
    "default-vision": (ReleaseSpec(head_dim=32, partial_rotary_factor=0.5, vision=VisionSpec()), 0, 1500),
    "wide-tower-two-attn": (
        ReleaseSpec(
            hidden_size=48, intermediate_size=96, num_hidden_layers=5, layer_types=[L, F, L, L, F],
            head_dim=24, partial_rotary_factor=0.5, num_attention_heads=2, num_key_value_heads=1,
            head={"hidden_size": 48, "width": 16, "routing_layers": 1, "layers": 2, "heads": 2,
                  "feedforward": 48},
            vision=VisionSpec(depth=3, hidden_size=48, intermediate_size=96, num_heads=3,
                              num_position_embeddings=144, hidden_act="gelu", max_pixels=32 * 32 * 30),
        ),
        4,
        1200,
    ),
}
REQUESTS = 8


def image_request(generator: RequestGenerator, rng: random.Random, samples: list) -> dict:
    request = generator.request(long_state=rng.random() < 0.2 or None)
    chosen = rng.sample(samples, rng.randint(1, 4))
    request["images"] = [
        as_data_url(data, fmt) if rng.random() < 0.5 else as_base64(data, line_breaks=rng.random() < 0.3)
        for _, data, fmt in chosen
    ]
    return request


def serve(backend: EngineBackend, requests: list[dict]) -> list[dict]:
    """Through the engine, all in flight together (they share steps)."""
    engine, decider = backend.engine, backend.decider
    assert engine is not None and decider is not None
    futures = []
    for body in requests:
        record, inputs = backend._prepare(decider, body)
        while True:
            try:
                futures.append(backend._submit(engine, body, record, True, inputs))
                break
            except QueueFullError:
                futures[0].result()
    return [f.result() for f in futures]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_engine_with_pictures_matches_reference_systemone(make_release, monkeypatch, case: str) -> None:
    spec, seed, max_length = CASES[case]
    folder = make_release(spec, seed=seed)
    decider = ClefDecider(folder, max_length=max_length)
    assert decider.takes_images
    backend = EngineBackend(decider, small_config(prefill_chunk_size=29, max_num_seqs=4, kv_cache_mb=16,
                                                  max_length=max_length), "m")
    ref = jsm()
    model, processor = reference_clef(folder)
    ref_probs: dict[int, dict[str, float]] = {}
    original_answer = ref.systemone_answer

    def capture_answer(question, probabilities):
        ref_probs[id(question)] = dict(probabilities)
        return original_answer(question, probabilities)

    monkeypatch.setattr(ref, "systemone_answer", capture_answer)
    rng, generator, samples = random.Random(seed), RequestGenerator(seed=500 + seed), assorted(seed)
    accepted, refused, pad_text = [], 0, 0
    while len(accepted) < REQUESTS:
        request = image_request(generator, rng, samples)
        if "<|image_pad|>" in json.dumps(request, ensure_ascii=False):
            pad_text += 1
            if pad_text > 1:  # one such request shows the refusal; more only cost reference time
                continue
        ref_probs.clear()
        try:
            expected = ref.systemone(model, processor, request, max_length=max_length)
        except ValueError as exc:
            # schema and pictures longer than max_length, or "<|image_pad|>" written in the text (the
            # reference's model fails on it): refused with a 4xx
            with pytest.raises(RequestError) as err:
                decider.encode(request)
            if "image tokens do not match" in str(exc):
                assert "<|image_pad|>" in err.value.message
            else:
                assert err.value.error_type == "tokens_exceeded", (err.value.message, str(exc))
            refused += 1
            continue
        probs = {qid: ref_probs[id(q)] for qid, q in request["questions"].items()}
        accepted.append((request, expected, probs))
    # every request twice: the second time the prefix cache answers it
    try:
        responses = serve(backend, [r for r, _, _ in accepted] * 2)
    finally:
        assert backend.engine is not None
        backend.engine.shutdown()
    worst, compared, flips, images = 0.0, 0, 0, 0
    for (request, expected, probs), ours in zip(accepted * 2, responses, strict=True):
        assert ours["usage"]["input_tokens"] == expected["usage"]["input_tokens"]
        for qid, answer in ours["answers"].items():
            raw = answer.pop("x_probabilities")
            worst = max(worst, max(abs(raw[o] - p) for o, p in probs[qid].items()))
        ours["usage"].pop("x_cached_tokens", None)
        report = assert_same_response(ours, expected, request, probs, tolerance=2e-4, margin=1e-5)
        compared += report.compared
        flips += len(report.boundary_flips)
        images += len(request["images"])
    assert worst <= 2e-4, worst
    assert pad_text >= 1, "no request wrote <|image_pad|> in its text"
    assert flips <= max(1, compared // 100), (flips, compared)
    stats = backend.stats()
    assert stats is not None and stats["prefix_hits"] >= len(accepted)
    print(f"{case}: {len(accepted)} requests x2 with {images // 2} pictures, {refused} refused, {compared} "
          f"values, {flips} boundary flips, max |dp| {worst:.2e}, prefix cache hits {stats['prefix_hits']}, "
          f"encoder cache hits {stats['encoder_cache_hits']}")

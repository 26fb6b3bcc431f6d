"""Records with pictures: the same ids, spans, pixel values and M-RoPE positions as the reference's encoder
with transformers' Qwen3VL processor (built without torchvision)."""

from __future__ import annotations

import io
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from clefserve.errors import RequestError
from clefserve.formats.clef.encoder import ClefEncoder
from clefserve.testing.release import ReleaseSpec, VisionSpec
from clefserve.vision.inputs import ImageInputs, ImageLimits
from clefserve.vision.preprocess import PreprocessorConfig
from tests.image_samples import as_base64, as_data_url, assorted, file_bytes
from tests.oracles import jsm, reference_processor

SPEC = ReleaseSpec(head=None, head_dim=32, partial_rotary_factor=0.5, vision=VisionSpec())
QUESTIONS = {
    "defect": {"type": "noul", "instructions": "Does the photo show a damaged item?"},
    "kind": {"type": "choice", "instructions": "What is shown?", "criteria": {"shoe": None, "bag": "A bag"}},
}


@pytest.fixture(scope="module")
def setup(make_release):
    folder = make_release(SPEC, seed=5)
    encoder = ClefEncoder.from_folder(folder, max_length=4096)
    images = ImageInputs(PreprocessorConfig.from_folder(folder), ImageLimits(max_images=4))
    return folder, encoder, images, reference_processor(folder)


def image_requests(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    samples = assorted(seed)
    out = []
    for i in range(count):
        chosen = rng.sample(samples, rng.randint(1, 4))
        entries = [as_data_url(data, fmt) if rng.random() < 0.5 else as_base64(data, rng.random() < 0.3)
                   for _, data, fmt in chosen]
        out.append({"model": "m", "state": {"note": f"photo set {i}", "n": len(entries)},
                    "questions": QUESTIONS, "images": entries})
    return out


def test_records_equal_the_reference(setup) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    _, encoder, images, processor = setup
    ref = jsm()
    requests = image_requests(0, 8)
    requests.append({**requests[0], "images": [requests[0]["images"][0]] * 2})  # the same picture twice
    for request in requests:
        prepared = images.prepare(request["images"])
        record = encoder.encode(request, prepared)
        expected = ref.encode_record(processor.tokenizer, request, max_length=4096, processor=processor)
        assert record.input_ids == expected.input_ids
        for ours, theirs in zip(record.questions, expected.questions, strict=True):
            assert ours.question_span == theirs.question_span and ours.option_spans == theirs.option_spans
        media = expected.media
        assert media["token_offset"] == record.prefix_end
        assert np.array_equal(np.concatenate([p.patches.pixels for p in prepared]),
                              media["pixel_values"].numpy())
        assert [p.patches.grid for p in prepared] == [tuple(g) for g in media["image_grid_thw"].tolist()]
        # M-RoPE positions as Qwen3_5Model computes them from the processor's token types
        token_types = torch.zeros(1, len(record.input_ids), dtype=torch.long)
        offset, types = media["token_offset"], torch.tensor(media["mm_token_type_ids"])
        token_types[0, offset:offset + len(types)] = types
        fake = SimpleNamespace(
            config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)),
            get_vision_position_ids=lambda *a, **k: Qwen3_5Model.get_vision_position_ids(None, *a, **k),
        )
        positions, _ = Qwen3_5Model.get_rope_index(fake, torch.tensor([record.input_ids]), token_types,
                                                   image_grid_thw=media["image_grid_thw"])
        assert torch.equal(record.positions(), positions[:, 0])


def test_cache_keys_tell_pictures_apart(setup) -> None:
    _, encoder, images, _ = setup
    samples = assorted(1)
    a, b = as_base64(samples[0][1]), as_base64(samples[1][1])
    base = {"model": "m", "state": "same", "questions": QUESTIONS}
    record_a = encoder.encode({**base, "images": [a]}, images.prepare([a]))
    again = encoder.encode({**base, "images": [as_data_url(samples[0][1], "PNG")]},
                           images.prepare([as_data_url(samples[0][1], "PNG")]))
    assert record_a.cache_keys() == again.cache_keys()  # same pixels, other encoding: same keys
    # same size, other pixels: equal ids, different keys from the first picture token on
    mirrored = Image.open(io.BytesIO(samples[0][1])).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    c = as_base64(file_bytes(mirrored, "PNG"))
    record_c = encoder.encode({**base, "images": [c]}, images.prepare([c]))
    assert record_c.input_ids == record_a.input_ids
    keys_a, keys_c = record_a.cache_keys(), record_c.cache_keys()
    span = record_a.images[0].span
    assert keys_a[: span.start] == keys_c[: span.start]
    assert all(x != y for x, y in zip(keys_a[span.start:span.end], keys_c[span.start:span.end], strict=True))
    record_b = encoder.encode({**base, "images": [b]}, images.prepare([b]))
    assert record_b.cache_keys() != record_a.cache_keys()


def test_state_is_cut_around_the_pictures(setup) -> None:
    folder, _, images, processor = setup
    ref = jsm()
    request = image_requests(2, 1)[0]
    request["state"] = {"text": "refund the broken shoe " * 300}
    prepared = images.prepare(request["images"])
    encoder = ClefEncoder.from_folder(folder, max_length=700)
    record = encoder.encode(request, prepared)
    expected = ref.encode_record(processor.tokenizer, request, max_length=700, processor=processor)
    assert record.input_ids == expected.input_ids and len(record.input_ids) == 700
    tight = ClefEncoder.from_folder(folder, max_length=record.media_end + 20)
    with pytest.raises(RequestError, match=r"schema and \d image\(s\) requires \d+ tokens"):
        tight.encode(request, prepared)


def test_images_without_a_vision_tower_are_refused(setup) -> None:
    _, encoder, _, _ = setup
    with pytest.raises(RequestError, match="images: this model does not take images"):
        encoder.encode({"model": "m", "state": 1, "questions": QUESTIONS, "images": ["aGk="]})
    with pytest.raises(RequestError, match="videos: video inputs are not supported"):
        encoder.encode({"model": "m", "state": 1, "questions": QUESTIONS, "videos": ["aGk="]})


def test_too_many_images(setup) -> None:
    _, _, images, _ = setup
    with pytest.raises(RequestError, match=r"images: at most 4 images per request \(--max-images\), got 5"):
        images.prepare(["aGk="] * 5)

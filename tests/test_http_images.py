"""Images over HTTP: hostile inputs get a quick 4xx naming the field, nothing is fetched or read, and the
server answers the next request; a good request with pictures answers like the one-piece reference path.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import json
import socket
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from clefserve.config import EngineConfig
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.server import create_app
from clefserve.testing.release import ReleaseSpec, VisionSpec
from clefserve.vision.decode import max_text_length
from tests.image_samples import as_base64, as_data_url, file_bytes, picture, png_declaring

SPEC = ReleaseSpec(head_dim=32, partial_rotary_factor=0.5, vision=VisionSpec())
MAX_IMAGE_BYTES = 64 << 10
QUESTIONS = {"damaged": {"type": "noul", "instructions": "Is the parcel damaged?"}}


def config(**overrides: Any) -> EngineConfig:
    values = dict(max_num_seqs=2, prefill_chunk_size=64, block_size=16, kv_cache_mb=8, max_length=1024,
                  max_image_bytes=MAX_IMAGE_BYTES, max_image_pixels=1_000_000, max_body_bytes=64 << 10)
    values.update(overrides)
    return EngineConfig(**values)


@pytest.fixture(scope="module")
def client(make_release):
    settings = config()
    decider = ClefDecider(make_release(SPEC, seed=9), max_length=1024,
                          image_limits=_limits(settings))
    with TestClient(create_app(EngineBackend(decider, settings, "clef-vision"), settings)) as test_client:
        yield test_client


def _limits(settings: EngineConfig):
    from clefserve.vision.inputs import ImageLimits

    return ImageLimits(settings.max_images, settings.max_image_pixels, settings.max_image_bytes)


def body(images: Any = None, **extra: Any) -> dict:
    out = {"model": "m", "state": {"note": "the parcel arrived"}, "questions": QUESTIONS, **extra}
    if images is not None:
        out["images"] = images
    return out


def hostile_table(tmp_path) -> list[tuple[str, dict | str, int, str]]:
    real = tmp_path / "parcel.png"
    real.write_bytes(file_bytes(picture(32, 32), "PNG"))
    good = as_base64(file_bytes(picture(64, 48), "PNG"))
    png = file_bytes(picture(96, 96), "PNG")
    # a file just above --max-image-bytes whose base64 passes the length bound: the decoded size refuses it
    big = as_base64(file_bytes(picture(148, 148, seed=1), "BMP"))
    assert len(big) <= max_text_length(MAX_IMAGE_BYTES) and len(base64.b64decode(big)) > MAX_IMAGE_BYTES
    bigger = as_base64(file_bytes(picture(200, 200, seed=1), "BMP"))  # refused by its length alone
    return [
        ("https URL", body(["https://example.com/parcel.png"]), 422, "images[0]"),
        ("http URL to a local port", body([good, "http://127.0.0.1:9/x.png"]), 422, "images[1]"),
        ("path of a real file", body([str(real)]), 422, "images[0]"),
        ("file URL", body([f"file://{real}"]), 422, "images[0]"),
        ("not base64", body(["not an image at all!"]), 422, "images[0]"),
        ("base64 of text", body([base64.b64encode(b"plain text, no picture").decode()]), 422, "images[0]"),
        ("truncated PNG", body([as_base64(png[: len(png) // 3])]), 422, "images[0]"),
        ("decompression bomb", body([as_base64(png_declaring(60_000, 60_000))]), 413, "images[0]"),
        ("declared pixels above --max-image-pixels", body([as_base64(png_declaring(1200, 1000))]), 413,
         "images[0]"),
        ("image above --max-image-bytes", body([big]), 413, "images[0]"),
        ("base64 longer than --max-image-bytes allows", body([good, bigger]), 413, "images[1]"),
        ("TIFF", body([as_data_url(file_bytes(picture(16, 16), "TIFF"), "TIFF")]), 422, "images[0]"),
        ("aspect ratio 300:1", body([as_base64(file_bytes(picture(600, 2), "PNG"))]), 422, "images[0]"),
        ("data URL of text", body(["data:text/plain;base64,aGVsbG8="]), 422, "images[0]"),
        ("five images", body([good] * 5), 422, "images"),
        ("images not a list", body(good), 422, "images"),
        ("a number in images", body([good, 7]), 422, "images"),
        ("videos", body(None, videos=[good]), 422, "videos"),
        ("text above --max-body-bytes", body([good], padding="x" * (80 << 10)), 413, "--max-body-bytes"),
    ]


def test_hostile_images_are_refused_quickly_and_nothing_is_fetched_or_read(client, tmp_path, monkeypatch):
    connections: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        connections.append(args)
        raise OSError("tests forbid outbound connections")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    opened: list[str] = []
    real_open = builtins.open

    def watching_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", watching_open)
    table = hostile_table(tmp_path)
    assert len(table) >= 12
    times = []
    for name, request, status, field in table:
        started = time.perf_counter()
        response = client.post("/v1/systemone", content=json.dumps(request),
                               headers={"content-type": "application/json"})
        elapsed = time.perf_counter() - started
        times.append((name, elapsed))
        assert response.status_code == status, (name, response.status_code, response.text[:300])
        assert field in response.text, (name, response.text[:300])
        assert elapsed < 1.0, (name, elapsed)
    assert connections == []
    assert not [path for path in opened if "parcel.png" in path]
    assert client.get("/health").status_code == 200
    good = body([as_base64(file_bytes(picture(64, 48), "PNG"))])
    answered = client.post("/v1/systemone", json=good)
    assert answered.status_code == 200, answered.text
    print("hostile inputs, seconds each: " + ", ".join(f"{n} {t:.3f}" for n, t in times))


def test_request_with_images_and_the_body_limit(client, monkeypatch):
    """Four pictures in one request; decoding and the vision tower run off the event loop."""
    import clefserve.vision.inputs as inputs_module
    from clefserve.vision.encoder import VisionEncoder

    on_loop: list[str] = []
    called: list[str] = []

    def off_the_loop(fn):
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            called.append(fn.__name__)
            try:
                asyncio.get_running_loop()
                on_loop.append(fn.__name__)
            except RuntimeError:  # no event loop in this thread: a worker thread
                pass
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(inputs_module, "decode_image", off_the_loop(inputs_module.decode_image))
    monkeypatch.setattr(VisionEncoder, "_encode", off_the_loop(VisionEncoder._encode))
    settings = config()
    pictures = [as_data_url(file_bytes(picture(40 + 10 * i, 30, seed=i), "PNG"), "PNG") for i in range(4)]
    response = client.post("/v1/systemone", json=body(pictures))
    assert response.status_code == 200, response.text
    assert on_loop == [] and called.count("decode_image") == 4 and called.count("_encode") == 4
    usage = response.json()["usage"]
    assert usage["input_tokens"] > 4 * 4
    # a body far above --max-body-bytes is fine when the excess is images within their own limit
    assert settings.max_body_bytes + settings.image_body_bytes > len(json.dumps(body(pictures)))


def test_images_to_a_release_without_a_vision_tower(make_release):
    settings = config()
    decider = ClefDecider(make_release(ReleaseSpec(), seed=21), max_length=1024)
    assert not decider.takes_images
    with TestClient(create_app(EngineBackend(decider, settings, "text-only"), settings)) as text_client:
        good = as_base64(file_bytes(picture(16, 16), "PNG"))
        response = text_client.post("/v1/systemone", json=body([good]))
        assert response.status_code == 422
        assert "images: this model does not take images" in response.text
        # a text-only model keeps the text body limit: no room for images
        response = text_client.post("/v1/systemone", json=body([good], padding="x" * (80 << 10)))
        assert response.status_code == 413
        assert text_client.post("/v1/systemone", json=body()).status_code == 200

"""TypeSafe image assets: the official SDK's image methods, unchanged, against a live server (assets as
multipart parts and as data_base64 in JSON), answered as ``images`` with the same pictures; and every bad
asset or multipart body a quick 4xx that names it, the server answering the next request."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict
from typesafe_sdk import Image, RetryPolicy, TypeSafeClient

from clefserve.config import EngineConfig
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.server import create_app
from clefserve.server.assets import MARKER, resolve_assets
from clefserve.testing.release import ReleaseSpec, VisionSpec
from clefserve.testing.server_process import ServerProcess
from tests.image_samples import as_base64, file_bytes, picture

SPEC = ReleaseSpec(head_dim=32, partial_rotary_factor=0.5, vision=VisionSpec())
SEED = 23
MAX_IMAGE_BYTES = 64 << 10
RAW_TOLERANCE = 1e-5
PNG = file_bytes(picture(96, 64, seed=1), "PNG")
JPEG = file_bytes(picture(48, 80, seed=2), "JPEG")
GIF = file_bytes(picture(40, 40, seed=3), "GIF")
REF_A, REF_B = f"<image:{'a' * 32}>", f"<image:{'b' * 32}>"


@pytest.fixture(scope="module")
def release(make_release) -> Path:
    return make_release(SPEC, seed=SEED)


# ---- the record: assets become images in order of first reference, references become markers ----

def test_assets_become_images_in_order_of_first_reference(release: Path) -> None:
    body = {"model": "m", "state": {"note": f"compare {REF_B} with {REF_A}", "again": REF_B},
            "questions": {"same": {"type": "noul", "instructions": f"Is {REF_A} like {REF_B}?"},
                          "kind": {"type": "choice", "criteria": {REF_A: f"like {REF_A}", "other": None}}},
            "assets": {REF_A: {"type": "image", "format": "png", "data_base64": as_base64(PNG)},
                       REF_B: {"type": "image", "format": "jpeg", "data_base64": as_base64(JPEG)}}}
    resolved = resolve_assets(body, None, 4, MAX_IMAGE_BYTES)
    one, two = MARKER.format(1), MARKER.format(2)
    assert resolved.body == {
        "model": "m", "state": {"note": f"compare {one} with {two}", "again": one},
        "questions": {"same": {"type": "noul", "instructions": f"Is {two} like {one}?"},
                      # a label (an object key) is never rewritten
                      "kind": {"type": "choice", "criteria": {REF_A: f"like {two}", "other": None}}},
        "images": [as_base64(JPEG), as_base64(PNG)]}
    assert resolved.names == [f"assets[{REF_B!r}]", f"assets[{REF_A!r}]"]
    assert "assets" in body and body["state"]["again"] == REF_B  # the request itself is left as it was
    decider = ClefDecider(release, max_length=1024)
    # the same record as the request with images and markers written by hand
    assert decider.encode(resolved.body).input_ids == decider.encode({
        **resolved.body, "images": [f"data:image/jpeg;base64,{as_base64(JPEG)}", as_base64(PNG)]}).input_ids


# ---- the official SDK against a live server ----

class RawResponse(BaseModel):
    """The response with the x_probabilities extension (the SDK's own model drops unknown fields)."""

    model_config = ConfigDict(extra="allow")
    model: str
    answers: dict[str, dict[str, Any]]
    usage: dict[str, Any]


@pytest.fixture(scope="module")
def server(release: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    srv = ServerProcess(release, tmp_path_factory.mktemp("assets") / "server.log", "--x-raw-probabilities",
                        "--max-image-bytes", str(MAX_IMAGE_BYTES))
    try:
        srv.wait_ready(180)
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[TypeSafeClient]:
    with TypeSafeClient(api_key="ignored", base_url=server.url, model="m", retry=RetryPolicy(max_retries=0),
                        timeout=120) as c:
        yield c


# plain dicts: the SDK sends them as they are, so the route can be sent the very same questions
QUESTIONS = {"damaged": {"type": "noul", "instructions": "Is the parcel damaged?"},
             "kind": {"type": "choice", "instructions": "What is shown?",
                      "criteria": {"parcel": None, "receipt": "A receipt"}},
             "urgency": {"type": "score", "instructions": "How urgent?",
                         "criteria": ["Later", "Today", "Now"]}}


def _route(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/systemone", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _same(ours: RawResponse, route: dict[str, Any]) -> None:
    assert ours.usage["input_tokens"] == route["usage"]["input_tokens"]
    assert list(ours.answers) == list(route["answers"])
    for qid, answer in route["answers"].items():
        for option, p in answer["x_probabilities"].items():
            assert abs(ours.answers[qid]["x_probabilities"][option] - p) <= RAW_TOLERANCE, (qid, option)


def test_sdk_multipart_assets_answer_like_images(client: TypeSafeClient, server: ServerProcess) -> None:
    """Image objects in the state and an attached one referenced in an f-string: the SDK sends a
    multipart body (the JSON, then one part per picture)."""
    photo, receipt = Image(PNG), Image.from_base64(as_base64(JPEG))
    with client.attach_assets(receipt):
        ours = client.system_one(state={"photo": photo, "note": f"the receipt is {receipt}"},
                                 questions=QUESTIONS, response_model=RawResponse)
    route = _route(server, {"model": "m", "state": {"photo": MARKER.format(1),
                                                    "note": f"the receipt is {MARKER.format(2)}"},
                            "questions": QUESTIONS, "images": [as_base64(PNG), as_base64(JPEG)]})
    _same(ours, route)


def test_sdk_assets_by_alias_and_as_the_whole_state(client: TypeSafeClient, server: ServerProcess) -> None:
    photo = Image.from_base64(as_base64(GIF))
    ours = client.system_one(state=photo, questions=QUESTIONS, assets={"parcel-photo": photo},
                             response_model=RawResponse)
    route = _route(server, {"model": "m", "state": MARKER.format(1), "questions": QUESTIONS,
                            "images": [as_base64(GIF)]})
    _same(ours, route)


def test_sdk_json_assets_with_data_base64(client: TypeSafeClient, server: ServerProcess) -> None:
    """The SDK sends ``assets`` given in extra_body as they are, in a JSON body."""
    photo = Image(PNG)
    ours = client.system_one(
        state=f"Photo: {photo}", questions=QUESTIONS, response_model=RawResponse,
        extra_body={"assets": {str(photo): {"type": "image", "format": "png",
                                            "data_base64": base64.b64encode(PNG).decode()}}})
    route = _route(server, {"model": "m", "state": f"Photo: {MARKER.format(1)}",
                            "questions": QUESTIONS, "images": [as_base64(PNG)]})
    _same(ours, route)


# ---- bad input ----

BOUNDARY = "b0undary"


def multipart(request: Any, *parts: tuple[str, str | None, bytes], first: str = "request",
              request_type: str = "application/json", boundary: str = BOUNDARY, close: bool = True) -> bytes:
    chunks = []
    payload = request if isinstance(request, bytes) else json.dumps(request).encode()
    for name, content_type, data in ((first, request_type, payload), *parts):
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n'
        if content_type is not None:
            head += f"Content-Type: {content_type}\r\n"
        chunks.append(head.encode() + b"\r\n" + data + b"\r\n")
    if close:
        chunks.append(f"--{boundary}--\r\n".encode())
    return b"".join(chunks)


def body(state: Any = None, assets: Any = None, **extra: Any) -> dict[str, Any]:
    out = {"model": "m", "state": f"see {REF_A}" if state is None else state,
           "questions": {"damaged": {"type": "noul", "instructions": "Damaged?"}}, **extra}
    if assets is not None:
        out["assets"] = assets
    return out


def part_asset(part: str = "asset-0") -> dict[str, str]:
    return {"type": "image", "part": part}


def data_asset(data: bytes = PNG, fmt: str | None = "png") -> dict[str, Any]:
    out: dict[str, Any] = {"type": "image", "data_base64": as_base64(data)}
    if fmt is not None:
        out["format"] = fmt
    return out


def form(request: Any, *parts: tuple[str, str | None, bytes], **options: Any) -> tuple[bytes, str]:
    return multipart(request, *parts, **options), f"multipart/form-data; boundary={BOUNDARY}"


def bad_inputs() -> list[tuple[str, Any, int, str]]:
    """(case, JSON body or (multipart bytes, content type), status, text the error must hold)."""
    big = file_bytes(picture(160, 160, seed=4), "BMP")
    assert len(big) > MAX_IMAGE_BYTES
    one = body(assets={REF_A: part_asset()})  # a request whose picture is part asset-0
    png0 = ("asset-0", "image/png", PNG)
    five = {f"<image:{c * 32}>": data_asset() for c in "abcde"}
    return [
        ("asset never referenced", body(assets={REF_A: data_asset(), REF_B: data_asset(JPEG, "jpeg")}), 422,
         REF_B),
        ("reference with no asset", body(f"{REF_A} and {REF_B}", {REF_A: data_asset()}), 422, REF_B),
        ("reference, no assets at all", body(), 422, REF_A),
        ("data_base64 without format", body(assets={REF_A: data_asset(fmt=None)}), 422, "format"),
        ("format that is no image format", body(assets={REF_A: data_asset(fmt="pdf")}), 422, "format"),
        ("neither data nor part", body(assets={REF_A: {"type": "image"}}), 422, REF_A),
        ("a video asset", body(assets={REF_A: {"type": "video", "part": "asset-0"}}), 422, "type"),
        ("assets not an object", body(assets=[data_asset()]), 422, "assets"),
        ("images and assets", body(assets={REF_A: data_asset()}, images=[as_base64(PNG)]), 422, "not both"),
        ("five assets", body(" ".join(five), five), 422, "--max-images"),
        ("data over --max-image-bytes", body(assets={REF_A: data_asset(big, "png")}), 413, REF_A),
        ("data that is no image", body(assets={REF_A: data_asset(b"plain text", "png")}), 422,
         f"assets[{REF_A!r}]"),
        ("a part in a JSON body", one, 422, "multipart"),
        ("part claimed twice", form(body(f"{REF_A} {REF_B}", {REF_A: part_asset(), REF_B: part_asset()}),
                                    png0), 422, "already claimed"),
        ("part never claimed", form(one, png0, ("asset-1", "image/png", PNG)), 422, "'asset-1'"),
        ("part missing", form(body(assets={REF_A: part_asset("asset-3")}), png0), 422, "asset-3"),
        ("part with a text content type", form(one, ("asset-0", "text/plain", PNG)), 415, "text/plain"),
        ("part that is no image", form(one, ("asset-0", "image/png", b"\x89PNG but not")), 422,
         "multipart part 'asset-0'"),
        ("part over --max-image-bytes", form(one, ("asset-0", "image/bmp", big)), 413, REF_A),
        ("request part not JSON", form(one, png0, request_type="text/plain"), 415, "'request'"),
        ("first part not the request", form(one, png0, first="json"), 422, "'request'"),
        ("two parts of one name", form(one, png0, png0), 422, "'asset-0'"),
        ("six parts", form(one, *((f"asset-{i}", "image/png", PNG) for i in range(5))), 413, "parts"),
        ("no closing boundary", (form(one, png0, close=False)[0][:-40], form(one)[1]), 400, "boundary"),
        ("no boundary parameter", (multipart(body()), "multipart/form-data"), 400, "boundary"),
        ("multipart/mixed", (multipart(body()), f"multipart/mixed; boundary={BOUNDARY}"), 415,
         "multipart/mixed"),
        ("request part not valid JSON", form(b"{not json", png0), 422, "JSON"),
    ]


@pytest.fixture(scope="module")
def http(release: Path) -> Iterator[TestClient]:
    settings = EngineConfig(max_num_seqs=2, prefill_chunk_size=64, kv_cache_mb=8, max_length=1024,
                            max_image_bytes=MAX_IMAGE_BYTES, max_body_bytes=64 << 10)
    decider = ClefDecider(release, max_length=1024)
    with TestClient(create_app(EngineBackend(decider, settings, "clef-vision"), settings)) as client:
        yield client


@pytest.mark.parametrize("case", range(len(bad_inputs())), ids=[c[0] for c in bad_inputs()])
def test_bad_assets_are_a_quick_4xx_naming_them(http: TestClient, case: int) -> None:
    name, payload, status, needle = bad_inputs()[case]
    started = time.perf_counter()
    if isinstance(payload, tuple):
        content, content_type = payload
        response = http.post("/v1/systemone", content=content, headers={"content-type": content_type})
    else:
        response = http.post("/v1/systemone", json=payload)
    elapsed = time.perf_counter() - started
    assert response.status_code == status, (name, response.text)
    assert needle in response.text, (name, response.text)
    assert elapsed < 1.0, (name, elapsed)
    good = multipart(body(assets={REF_A: part_asset()}), ("asset-0", "image/png", PNG))
    after = http.post("/v1/systemone", content=good,
                      headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert after.status_code == 200, after.text


def test_a_multipart_body_over_the_limit_is_a_413(http: TestClient) -> None:
    settings = EngineConfig(max_image_bytes=MAX_IMAGE_BYTES, max_body_bytes=64 << 10)
    limit = settings.max_body_bytes + settings.image_body_bytes
    content = multipart(body(assets={REF_A: part_asset()}), ("asset-0", "image/png", b"x" * (limit + 1)))
    response = http.post("/v1/systemone", content=content,
                         headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert response.status_code == 413 and "--max-body-bytes" in response.text


def test_workers_ai_route_takes_assets_too(http: TestClient) -> None:
    content = multipart(body(assets={REF_A: part_asset()}), ("asset-0", "image/png", PNG))
    response = http.post("/ai/run/@cf/cloudflare/clef", content=content,
                         headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert response.status_code == 200 and response.json()["success"] is True, response.text
    bad = http.post("/ai/run/@cf/cloudflare/clef", json=body(assets={REF_B: data_asset()}))  # REF_A dangles
    assert bad.status_code == 400 and REF_A in bad.json()["errors"][0]["message"], bad.text


def test_multipart_with_a_quoted_boundary_a_preamble_and_gzip(http: TestClient) -> None:
    """RFC 7578/2046 details a hand-written client may use: the answer is the JSON data asset's."""
    import gzip

    request = body(assets={REF_A: part_asset()})
    content = b"a preamble, ignored\r\n" + multipart(request, ("asset-0", None, PNG))
    response = http.post("/v1/systemone", content=gzip.compress(content),
                         headers={"content-type": f'multipart/form-data; boundary="{BOUNDARY}"',
                                  "content-encoding": "gzip"})
    assert response.status_code == 200, response.text
    inline = http.post("/v1/systemone", json=body(assets={REF_A: data_asset()}))
    assert inline.status_code == 200
    assert response.json()["answers"] == inline.json()["answers"]

"""Malformed System One bodies: each gets a 4xx whose loc/message names the problem, never a 5xx."""

from __future__ import annotations

import gzip
import json
import lzma
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clefserve.config import EngineConfig
from clefserve.server import create_app, decoding
from clefserve.server.limits import MAX_JSON_DEPTH
from tests.http_fakes import FakeBackend

GOOD: dict[str, Any] = {
    "model": "clef-flash",
    "state": {"message": "I was charged twice for order A-104."},
    "questions": {
        "billing": {"type": "noul", "instructions": "Is `message` about a payment?"},
        "team": {"type": "choice", "instructions": "Which team?",
                 "criteria": {"billing": "Payments", "sales": None}},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["Can wait", "Today", "Now"]},
    },
}
MIB = 1 << 20


def body(**top: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(GOOD))
    for key, value in top.items():
        if value is ...:
            del out[key]
        else:
            out[key] = value
    return out


def question(**fields: Any) -> dict[str, Any]:
    return body(questions={"q": fields})


def nested(depth: int) -> str:
    """A body whose state is ``depth - 1`` nested arrays (the body object is level 1)."""
    state = "[" * (depth - 1) + "]" * (depth - 1)
    return '{"model": "m", "questions": {"q": {"type": "noul"}}, "state": ' + state + "}"


def labels(n: int) -> dict[str, None]:
    return {f"label{i}": None for i in range(n)}


GZIP = {"content-encoding": "gzip"}

# (id, body: dict -> JSON, str/bytes -> sent as is, extra headers, status, expected loc or None, message part)
CASES: list[tuple[str, Any, dict[str, str], int, list[Any] | None, str]] = [
    ("missing-model", body(model=...), {}, 422, ["body", "model"], "required"),
    ("missing-state", body(state=...), {}, 422, ["body", "state"], "required"),
    ("missing-questions", body(questions=...), {}, 422, ["body", "questions"], "required"),
    ("model-not-string", body(model=123), {}, 422, ["body", "model"], "string"),
    ("questions-array", body(questions=[{"type": "noul"}]), {}, 422, ["body", "questions"], "dictionary"),
    ("questions-empty", body(questions={}), {}, 422, ["body", "questions"], "at least 1"),
    ("questions-65", body(questions={f"q{i}": {"type": "noul"} for i in range(65)}), {}, 422,
     ["body", "questions"], "at most 64"),
    ("question-id-empty", body(questions={"": {"type": "noul"}}), {}, 422, ["body", "questions"],
     "non-empty"),
    ("question-not-object", body(questions={"q": "Is it spam?"}), {}, 422, ["body", "questions", "q"],
     "object"),
    ("type-missing", question(instructions="x"), {}, 422, ["body", "questions", "q"], 'needs a "type"'),
    ("type-unknown", question(type="box", instructions="the dog"), {}, 422, ["body", "questions", "q"],
     "'box'"),
    ("unknown-question-field", question(type="noul", instruction="typo"), {}, 422,
     ["body", "questions", "q", "noul", "instruction"], "extra"),
    ("instructions-number", question(type="noul", instructions=42), {}, 422,
     ["body", "questions", "q", "noul", "instructions"], "not a number"),
    ("instructions-bool", question(type="noul", instructions=True), {}, 422,
     ["body", "questions", "q", "noul", "instructions"], "not a boolean"),
    ("choice-no-criteria", question(type="choice"), {}, 422, ["body", "questions", "q", "choice", "criteria"],
     "required"),
    ("choice-0-labels", question(type="choice", criteria={}), {}, 422,
     ["body", "questions", "q", "choice", "criteria"], "at least 2"),
    ("choice-1-label", question(type="choice", criteria={"yes": None}), {}, 422,
     ["body", "questions", "q", "choice", "criteria"], "at least 2"),
    ("choice-256-labels", question(type="choice", criteria=labels(256)), {}, 422,
     ["body", "questions", "q", "choice", "criteria"], "at most 255"),
    ("choice-empty-label", question(type="choice", criteria={"": "blank", "b": None}), {}, 422,
     ["body", "questions", "q", "choice", "criteria"], "non-empty"),
    ("choice-criteria-list", question(type="choice", criteria=["a", "b"]), {}, 422,
     ["body", "questions", "q", "choice", "criteria"], "dictionary"),
    ("choice-description-number", question(type="choice", criteria={"a": 1, "b": None}), {}, 422,
     ["body", "questions", "q", "choice", "criteria", "a"], "not a number"),
    ("score-no-criteria", body(questions={"urgency": {"type": "score"}}), {}, 422,
     ["body", "questions", "urgency", "score", "criteria"], "required"),
    ("score-1-level", question(type="score", criteria=["only"]), {}, 422,
     ["body", "questions", "q", "score", "criteria"], "at least 2"),
    ("score-11-levels", question(type="score", criteria=[str(i) for i in range(11)]), {}, 422,
     ["body", "questions", "q", "score", "criteria"], "at most 10"),
    ("score-criteria-object", question(type="score", criteria={"0": "low", "1": "high"}), {}, 422,
     ["body", "questions", "q", "score", "criteria"], "array"),
    ("score-level-number", question(type="score", criteria=["low", 2]), {}, 422,
     ["body", "questions", "q", "score", "criteria", 1], "not a number"),
    ("score-level-null", question(type="score", criteria=["calm", None, "furious"]), {}, 422,
     ["body", "questions", "q", "score", "criteria", 1], "must be a string"),
    ("score-level-bool", question(type="score", criteria=[True, "high"]), {}, 422,
     ["body", "questions", "q", "score", "criteria", 0], "not a boolean"),
    ("score-level-empty", question(type="score", criteria=["low", "mid", ""]), {}, 422,
     ["body", "questions", "q", "score", "criteria", 2], "empty"),
    ("score-level-blank", question(type="score", criteria=[" \t\n", "high"]), {}, 422,
     ["body", "questions", "q", "score", "criteria", 0], "blank"),
    ("score-level-object", question(type="score", criteria=["low", {"text": "high"}]), {}, 422,
     ["body", "questions", "q", "score", "criteria", 1], "must be a string, not an object"),
    ("score-level-empty-object", question(type="score", criteria=["low", {}]), {}, 422,
     ["body", "questions", "q", "score", "criteria", 1], "must be a string, not an object"),
    ("score-level-array", question(type="score", criteria=[["low"], "high"]), {}, 422,
     ["body", "questions", "q", "score", "criteria", 0], "must be a string, not an array"),
    ("noul-criteria-unknown-key", question(type="noul", criteria={"true": "yes", "maybe": "?"}), {}, 422,
     ["body", "questions", "q", "noul", "criteria", "maybe"], "extra"),
    ("noul-criteria-string", question(type="noul", criteria="yes"), {}, 422,
     ["body", "questions", "q", "noul", "criteria"], "dictionary"),
    ("media-videos", body(videos=["aGVsbG8="]), {}, 422, ["body", "videos"], "not supported"),
    ("images-not-a-list", body(images="aGVsbG8="), {}, 422, ["body", "images"], "list"),
    ("images-entry-number", body(images=["aGVsbG8=", 7]), {}, 422, ["body", "images", 1], "string"),
    ("body-array", [GOOD], {}, 422, ["body"], "dictionary"),
    ("body-string", '"hello"', {}, 422, ["body"], "dictionary"),
    ("not-json", "model=clef&state=x", {}, 422, None, "JSON decode error"),
    ("empty-body", "", {}, 422, ["body"], "empty"),
    ("truncated-json", json.dumps(GOOD)[:-5], {}, 422, None, "JSON decode error"),
    ("nan-literal", '{"model": "m", "state": NaN, "questions": {"q": {"type": "noul"}}}', {}, 422, ["body"],
     "NaN"),
    ("infinity-literal", '{"model": "m", "state": [Infinity], "questions": {"q": {"type": "noul"}}}', {}, 422,
     ["body"], "Infinity"),
    ("minus-infinity-literal", '{"model": "m", "state": -Infinity, "questions": {"q": {"type": "noul"}}}', {},
     422, ["body"], "-Infinity"),
    ("float-overflow", '{"model": "m", "state": 1e400, "questions": {"q": {"type": "noul"}}}', {}, 422,
     ["body"], "out of range"),
    ("huge-integer", '{"model": "m", "state": ' + "9" * 5000 + ', "questions": {"q": {"type": "noul"}}}', {},
     422, ["body"], "5000 digits"),
    ("duplicate-question-id", '{"model": "m", "state": 1, "questions": {"q": {"type": "noul"}, '
     '"q": {"type": "score", "criteria": ["a", "b"]}}}', {}, 422, ["body"], "duplicate key 'q'"),
    ("invalid-utf8", b'{"model": "m", "state": "\xff\xfe", "questions": {"q": {"type": "noul"}}}', {}, 422,
     ["body"], "UTF-8"),
    ("lone-surrogate", '{"model": "m", "state": "\\ud800", "questions": {"q": {"type": "noul"}}}', {}, 422,
     ["body", "state"], "surrogate"),
    ("nested-100k", nested(100_000), {}, 422, ["body"], "nested deeper"),
    ("nested-65", nested(MAX_JSON_DEPTH + 1), {}, 422, ["body", "state"], "nested deeper"),
    ("body-2mib", json.dumps(body(state="x" * (2 * MIB))), {}, 413, None, "larger than"),
    ("multipart", "--x\r\n\r\n", {"content-type": "multipart/form-data; boundary=x"}, 400, None, "multipart"),
    ("encoding-unknown", json.dumps(GOOD), {"content-encoding": "br"}, 415, None, "'br'"),
    ("encoding-corrupt", b"\x1f\x8b not really gzip", GZIP, 400, None, "gzip"),
    ("gzip-bomb", gzip.compress(json.dumps(body(state=" " * (3 * MIB))).encode()), GZIP, 413, None,
     "larger than"),
]


@pytest.fixture(scope="module")
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="module")
def client(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend, EngineConfig()), raise_server_exceptions=False) as c:
        yield c


def send(client: TestClient, payload: Any, headers: dict[str, str] | None = None):
    if isinstance(payload, dict | list):
        payload = json.dumps(payload)
    if isinstance(payload, str):
        payload = payload.encode("utf-8", "surrogatepass")
    return client.post("/v1/systemone", content=payload,
                       headers={"content-type": "application/json", **(headers or {})})


def assert_names_problem(response, status: int, loc: list[Any] | None, needle: str) -> None:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    if isinstance(detail, list):
        assert all({"loc", "msg", "type"} <= item.keys() for item in detail)
        if loc is not None:
            assert loc in [item["loc"] for item in detail], detail
        messages = " | ".join(item["msg"] for item in detail if loc is None or item["loc"] == loc)
    else:
        assert set(detail) == {"message", "error_type"}
        messages = detail["message"]
    assert needle.lower() in messages.lower(), detail


def test_table_is_big_enough() -> None:
    assert len(CASES) >= 25
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize(("payload", "headers", "status", "loc", "needle"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_malformed_body(client: TestClient, backend: FakeBackend, payload: Any, headers: dict[str, str],
                        status: int, loc: list[Any] | None, needle: str) -> None:
    seen = len(backend.bodies)
    response = send(client, payload, headers)
    assert_names_problem(response, status, loc, needle)
    assert len(backend.bodies) == seen, "a refused body reached the backend"
    assert response.headers["x-request-id"]


def test_good_request_answered_after_all_bad_ones(client: TestClient, backend: FakeBackend) -> None:
    for _, payload, headers, status, _, _ in CASES:
        assert send(client, payload, headers).status_code == status
    response = send(client, GOOD)
    assert response.status_code == 200, response.text
    answers = response.json()["answers"]
    assert list(answers) == ["billing", "team", "urgency"]
    assert [a["type"] for a in answers.values()] == ["noul", "choice", "score"]


def test_chunked_body_over_limit_is_413(client: TestClient, backend: FakeBackend) -> None:
    """No Content-Length: the limit is enforced on the bytes actually received."""
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", "questions": {"q": {"type": "noul"}}, "state": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    seen = len(backend.bodies)
    response = client.post("/v1/systemone", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_names_problem(response, 413, None, "larger than")
    assert len(backend.bodies) == seen


def test_body_limit_follows_config(backend: FakeBackend) -> None:
    with TestClient(create_app(backend, EngineConfig(max_body_bytes=1000))) as small:
        assert send(small, body(state="x" * 500)).status_code == 200
        assert_names_problem(send(small, body(state="x" * 1000)), 413, None, "1000 bytes")


def test_nesting_at_the_limit_is_accepted(client: TestClient) -> None:
    assert send(client, nested(MAX_JSON_DEPTH)).status_code == 200


# Bodies at the edges of what is valid: each is answered 200 (by the fake backend and by a real model).
VALID: dict[str, dict[str, Any]] = {
    "state-null": body(state=None),
    "state-text": body(state="plain text"),
    "state-array": body(state=[1, 2.5, {"a": None}]),
    "unknown-top-level": body(extra_field={"ignored": True}, stream=False, images=None),
    "noul-bare": question(type="noul"),
    "noul-one-sided": question(type="noul", instructions=None, criteria={"true": "Spam"}),
    "noul-null-descriptions": question(type="noul", criteria={"true": None, "false": None}),
    "noul-criteria-null": question(type="noul", criteria=None),
    "json-descriptions": question(type="choice", instructions={"task": "pick", "fields": ["a"]},
                                  criteria={"a": {"x": 1}, "b": ["y"], "c": None}),
    "choice-255": question(type="choice", criteria=labels(255)),
    "score-10": question(type="score", criteria=[str(i) for i in range(10)]),
    "score-padded-levels": question(type="score", criteria=["low", " mid ", "high\n", "x y"]),
    "questions-64": body(questions={f"id {i} -é.": {"type": "noul"} for i in range(64)}),
    "good": GOOD,
}


@pytest.mark.parametrize("payload", list(VALID.values()), ids=list(VALID))
def test_valid_edge_cases_are_accepted(client: TestClient, payload: dict[str, Any]) -> None:
    response = send(client, payload)
    assert response.status_code == 200, response.text
    assert list(response.json()["answers"]) == list(payload["questions"])


def test_backend_gets_the_body_exactly_as_sent(client: TestClient, backend: FakeBackend) -> None:
    raw = ('{"questions": {"z": {"criteria": ["b", "a"], "type": "score"}, "a": {"type": "noul"}}, '
           '"state": {"b": 1.0, "a": 1, "c": [2.50, -0.0, 1e3]}, "model": "m", "x_extra": 3}')
    assert send(client, raw).status_code == 200
    got = backend.bodies[-1]
    assert got == json.loads(raw)
    assert json.dumps(got) == json.dumps(json.loads(raw))  # key order and int/float kinds kept
    assert isinstance(got["state"]["b"], float) and isinstance(got["state"]["a"], int)


def test_gzip_body_is_accepted(client: TestClient) -> None:
    response = send(client, gzip.compress(json.dumps(GOOD).encode()), GZIP)
    assert response.status_code == 200, response.text


def test_zstd_style_decoder_is_bounded(monkeypatch: pytest.MonkeyPatch, client: TestClient) -> None:
    """zstd decompressors share lzma's interface: lzma stands in where no zstd module is installed."""
    monkeypatch.setitem(decoding.DECODERS, "zstd", lzma.LZMADecompressor)
    ok = send(client, lzma.compress(json.dumps(GOOD).encode()), {"content-encoding": "zstd"})
    assert ok.status_code == 200, ok.text
    bomb = send(client, lzma.compress(json.dumps(body(state=" " * (2 * MIB))).encode()),
                {"content-encoding": "zstd"})
    assert_names_problem(bomb, 413, None, "larger than")
    truncated = send(client, lzma.compress(json.dumps(GOOD).encode())[:-20], {"content-encoding": "zstd"})
    assert_names_problem(truncated, 400, None, "zstd")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
question_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["noul", "choice", "score", "box", ""]) | json_values},
    optional={"instructions": json_values, "criteria": json_values, "extra": json_values},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.one_of(
    json_values,
    st.fixed_dictionaries({"model": json_values, "state": json_values,
                           "questions": st.dictionaries(st.text(max_size=6), question_like, max_size=4)}),
    st.binary(max_size=64),
))
def test_no_input_gives_a_5xx(client: TestClient, payload: Any) -> None:
    response = send(client, payload if isinstance(payload, bytes) else json.dumps(payload))
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert response.status_code in (400, 413, 415, 422)
        assert "detail" in response.json()


@pytest.fixture(scope="module")
def real_client(make_release) -> Iterator[TestClient]:
    from clefserve.formats.clef import ClefDecider
    from clefserve.formats.clef.engine_backend import EngineBackend

    config = EngineConfig(kv_cache_mb=32, prefill_chunk_size=2048)
    backend = EngineBackend(ClefDecider(make_release(seed=5)), config, "clef-validation")
    with TestClient(create_app(backend, config), raise_server_exceptions=False) as c:
        yield c


def test_the_official_sdk_parses_every_200_of_the_table(real_client: TestClient) -> None:
    """Every valid edge case, answered by a real model, parses with typesafe-sdk's strict response model
    (a null score level once came back as ``legend: {"1": null}``, which it refuses)."""
    import httpx2
    from typesafe_sdk import SystemOneResponse

    for name, payload in VALID.items():
        response = send(real_client, payload)
        assert response.status_code == 200, (name, response.text)
        parsed = SystemOneResponse.from_http_response(httpx2.Response(
            200, content=response.content, headers=dict(response.headers),
            request=httpx2.Request("POST", "http://clef-serve/v1/systemone")))
        assert list(parsed.answers) == list(payload["questions"]), name
        for qid, answer in parsed.scores.items():
            assert list(answer.legend.values()) == payload["questions"][qid]["criteria"], name


@pytest.mark.parametrize("kind", ["box", "predict", "Noul"])
def test_question_types_the_model_cannot_answer(client: TestClient, backend: FakeBackend, kind: str) -> None:
    seen = len(backend.bodies)
    payload = body(questions={"billing": {"type": "noul"}, "dog": {"type": kind, "instructions": "The dog"}})
    response = send(client, payload)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail["error_type"] == "unsupported_question_type"
    assert f"question 'dog' ('{kind}')" in detail["message"]
    assert "it answers noul, choice, score questions" in detail["message"]
    assert len(backend.bodies) == seen


OVER_LIMIT = {  # flag: (body over the default, body at a raised limit, body over the raised limit)
    "--max-questions": (body(questions={f"q{i}": {"type": "noul"} for i in range(65)}),
                        body(questions={f"q{i}": {"type": "noul"} for i in range(80)}),
                        body(questions={f"q{i}": {"type": "noul"} for i in range(81)})),
    "--max-choice-labels": (question(type="choice", criteria=labels(256)),
                            question(type="choice", criteria=labels(300)),
                            question(type="choice", criteria=labels(301))),
    "--max-score-levels": (question(type="score", criteria=[f"l{i}" for i in range(11)]),
                           question(type="score", criteria=[f"l{i}" for i in range(16)]),
                           question(type="score", criteria=[f"l{i}" for i in range(17)])),
}


@pytest.mark.parametrize("flag", list(OVER_LIMIT))
def test_every_count_limit_names_the_flag_that_raises_it(backend: FakeBackend, flag: str) -> None:
    over_default, at_raised, over_raised = OVER_LIMIT[flag]
    raised = EngineConfig(max_questions=80, max_choice_labels=300, max_score_levels=16)
    with TestClient(create_app(backend, EngineConfig())) as default, \
            TestClient(create_app(backend, raised)) as custom:
        assert_names_problem(send(default, over_default), 422, None, f"(this server's {flag})")
        assert send(custom, over_default).status_code == 200
        assert send(custom, at_raised).status_code == 200
        limit = {"--max-questions": 80, "--max-choice-labels": 300, "--max-score-levels": 16}[flag]
        assert_names_problem(send(custom, over_raised), 422, None, f"at most {limit} allowed")
        assert_names_problem(send(custom, over_raised), 422, None, f"(this server's {flag})")
        schemas = custom.get("/openapi.json").json()["components"]["schemas"]
        assert schemas["SystemOneRequest"]["properties"]["questions"]["maxProperties"] == 80
        assert schemas["ChoiceQuestion"]["properties"]["criteria"]["maxProperties"] == 300
        assert schemas["ScoreQuestion"]["properties"]["criteria"]["maxItems"] == 16

"""Fuzzing from the OpenAPI document: bodies generated from ``app.openapi()`` (valid ones, corrupted ones,
mangled bytes and headers) never get a 5xx and never stop the server; once with a fake backend and once
with a real tiny model in-process. (schemathesis is not a dependency: the strategies are built here.)"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clefserve.config import EngineConfig
from clefserve.server import create_app
from tests.http_fakes import FakeBackend

SETTINGS = {"deadline": None, "derandomize": True,
            "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.data_too_large]}
CLIENT_ERRORS = {400, 405, 413, 415, 422}
GOOD = {"model": "clef-flash", "state": {"message": "charged twice"},
        "questions": {"billing": {"type": "noul"},
                      "team": {"type": "choice", "criteria": {"billing": "Payments", "sales": None}},
                      "urgency": {"type": "score", "criteria": ["later", "now"]}}}

json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


class SchemaStrategies:
    """Hypothesis strategies for the JSON Schema subset that FastAPI/pydantic write.

    ``wild``: every node may instead be any JSON value, objects may lose required keys and gain unknown
    ones, and sizes may step one past their bounds: near-valid bodies with local faults.
    """

    def __init__(self, openapi: dict[str, Any], wild: bool) -> None:
        self.components = openapi["components"]["schemas"]
        self.wild = wild

    def of(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        strict = self._strict(schema)
        return st.one_of(strict, strict, strict, json_values) if self.wild else strict

    def _strict(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            return st.deferred(lambda: self.of(self.components[name]))
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        for key in ("oneOf", "anyOf"):
            if key in schema:
                return st.one_of([self.of(option) for option in schema[key]])
        kind = schema.get("type")
        if kind is None:
            return json_values
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            low, high = self._bounds(schema, "minItems", "maxItems")
            return st.lists(self.of(schema.get("items", {})), min_size=low, max_size=high)
        if kind == "string":
            text = st.text(min_size=schema.get("minLength", 0), max_size=20)
            return text.filter(re.compile(schema["pattern"]).search) if "pattern" in schema else text
        if kind == "integer":
            return st.integers(-(2**40), 2**40)
        if kind == "number":
            return st.floats(allow_nan=False, allow_infinity=False)
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        raise NotImplementedError(f"schema type {kind!r}")

    def _bounds(self, schema: dict[str, Any], low_key: str, high_key: str) -> tuple[int, int]:
        low = schema.get(low_key, 0)
        high = min(schema.get(high_key, low + 4), low + 4)  # small bodies; the limits have their own tests
        if self.wild:
            low, high = max(0, low - 1), high + (high == schema.get(high_key))
        return low, high

    def _object(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        if not properties:
            values = self.of(extra) if isinstance(extra, dict) else json_values
            low, high = self._bounds(schema, "minProperties", "maxProperties")
            # non-empty names (ids, labels) in valid bodies: the rule is not in the schema; wild bodies
            # still get empty ones
            keys = st.text(max_size=10) if self.wild else st.text(min_size=1, max_size=10)
            return st.dictionaries(keys, values, min_size=low, max_size=high)
        required = set(schema.get("required", ()))
        fields = {name: self.of(sub) for name, sub in properties.items()}
        strict = st.fixed_dictionaries({k: v for k, v in fields.items() if k in required},
                                       optional={k: v for k, v in fields.items() if k not in required})
        if not self.wild:
            return strict
        loose = st.fixed_dictionaries({}, optional=fields)
        unknown = st.dictionaries(st.text(max_size=8), json_values, max_size=2)
        return st.builds(lambda base, more: {**more, **base}, strict | loose, unknown)


def request_schema(app) -> dict[str, Any]:
    return {"$ref": "#/components/schemas/SystemOneRequest"}


# Every route that takes the System One body: the contract's, OpenRouter's, Workers AI's (in its envelope).
ROUTES = ["/v1/systemone", "/api/alpha/decisions", "/api/v1/systemone",
          "/client/v4/accounts/acc/ai/run/@cf%2Fcloudflare%2Fclef-flash", "/ai/run/@cf/cloudflare/clef"]
ENVELOPED = ("/client/", "/ai/")


@dataclass
class Reply:
    """A response as the checks read it: on a Workers AI route, the envelope's result or errors."""

    status_code: int
    body: Any
    headers: Any

    @property
    def text(self) -> str:
        return json.dumps(self.body)

    def json(self) -> Any:
        return self.body


def send(client: TestClient, body: Any, headers: dict[str, Any] | None = None,
         path: str = ROUTES[0]) -> Reply:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post(path, content=content,
                           headers={"content-type": "application/json", **(headers or {})})
    out = response.json()
    if path.startswith(ENVELOPED):
        assert set(out) == {"success", "result", "errors", "messages"}, out
        assert out["success"] is (response.status_code == 200)
        out = out["result"] if out["success"] else {"detail": out["errors"]}
    return Reply(response.status_code, out, response.headers)


def has_empty_name(body: dict[str, Any]) -> bool:
    """Ids and labels must be non-empty: a rule the JSON Schema cannot state."""
    questions = body["questions"]
    return "" in questions or any(
        q["type"] == "choice" and "" in q["criteria"] for q in questions.values())


def assert_answers(body: dict[str, Any], response) -> None:
    out = response.json()
    assert out["model"] == body["model"] or out["model"].startswith("@cf/cloudflare/")
    assert list(out["answers"]) == list(body["questions"])
    for qid, answer in out["answers"].items():
        assert answer["type"] == body["questions"][qid]["type"]


def byte_mangled() -> st.SearchStrategy[bytes]:
    raw = json.dumps(GOOD).encode()

    def mangle(cut: int, insert: bytes, drop: int) -> bytes:
        cut %= len(raw) + 1
        return raw[:cut] + insert + raw[cut + drop:]

    return st.builds(mangle, st.integers(0, len(raw)), st.binary(max_size=8), st.integers(0, 8))


HEADERS: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries({}, optional={
    "content-type": st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=x",
                                     "application/json; charset=latin-1", ""]),
    "content-encoding": st.sampled_from(["gzip", "deflate", "zstd", "br", "identity", "gzip, gzip", "x"]),
    "authorization": st.sampled_from(["Bearer x", "Basic Zm9vOmJhcg==", "garbage"]),
    "x-request-id": st.text(max_size=12).map(lambda s: s.encode("utf-8")),  # any bytes, not only ASCII
})


# ---- a fake backend: many examples -------------------------------------------------------------------

@pytest.fixture(scope="module")
def fake() -> Iterator[TestClient]:
    with TestClient(create_app(FakeBackend(), EngineConfig()), raise_server_exceptions=False) as client:
        yield client


def test_openapi_has_the_request_schema(fake: TestClient) -> None:
    schema = fake.get("/openapi.json").json()
    assert "SystemOneRequest" in schema["components"]["schemas"]
    assert set(schema["paths"]) >= {"/v1/systemone", "/v1/models", "/health", "/ready"}


@pytest.fixture(scope="module")
def strategies(fake: TestClient) -> tuple[SchemaStrategies, SchemaStrategies]:
    openapi = fake.app.openapi()
    return SchemaStrategies(openapi, wild=False), SchemaStrategies(openapi, wild=True)


def test_schema_valid_bodies_are_answered(fake: TestClient, strategies) -> None:
    strict, _ = strategies

    @settings(max_examples=150, **SETTINGS)
    @given(body=strict.of(request_schema(fake.app)), path=st.sampled_from(ROUTES))
    def check(body: dict[str, Any], path: str) -> None:
        response = send(fake, body, path=path)
        if has_empty_name(body):
            assert response.status_code == (400 if path.startswith(ENVELOPED) else 422), response.text
            assert "non-empty" in response.text
        else:
            assert response.status_code == 200, response.text
            assert_answers(body, response)

    check()


def test_corrupted_bodies_never_get_a_5xx(fake: TestClient, strategies) -> None:
    _, wild = strategies

    @settings(max_examples=300, **SETTINGS)
    @given(body=wild.of(request_schema(fake.app)), path=st.sampled_from(ROUTES))
    def check(body: Any, path: str) -> None:
        response = send(fake, body, path=path)
        assert response.status_code == 200 or response.status_code in CLIENT_ERRORS, response.text
        assert "detail" in response.json() or response.status_code == 200

    check()


def test_mangled_bytes_and_headers_never_get_a_5xx(fake: TestClient) -> None:
    @settings(max_examples=200, **SETTINGS)
    @given(content=byte_mangled() | st.binary(max_size=64), headers=HEADERS, path=st.sampled_from(ROUTES))
    def check(content: bytes, headers: dict[str, Any], path: str) -> None:
        response = send(fake, content, headers, path)
        assert response.status_code == 200 or response.status_code in CLIENT_ERRORS, response.text
        assert response.headers["x-request-id"]

    check()


def test_every_documented_route_survives_odd_requests(fake: TestClient) -> None:
    paths = [*sorted(fake.app.openapi()["paths"]), "/metrics", "/openapi.json", "/nope"]

    @settings(max_examples=100, **SETTINGS)
    @given(path=st.sampled_from(paths), method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD"]),
           query=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2), headers=HEADERS)
    def check(path: str, method: str, query: dict[str, str], headers: dict[str, Any]) -> None:
        response = fake.request(method, path, params=query, headers=headers, content=b"{}")
        assert response.status_code < 500, (method, path, response.text)

    check()


def test_fake_server_still_answers_after_fuzzing(fake: TestClient) -> None:
    assert fake.get("/health").status_code == 200
    response = send(fake, GOOD)
    assert response.status_code == 200
    assert_answers(GOOD, response)
    metrics = fake.get("/metrics").text
    assert 'route="/v1/systemone",status="500"' not in metrics


# ---- a real tiny model in-process: fewer examples ----------------------------------------------------

@pytest.fixture(scope="module")
def real(make_release) -> Iterator[tuple[TestClient, Any]]:
    from clefserve.formats.clef import ClefDecider
    from clefserve.formats.clef.engine_backend import EngineBackend

    config = EngineConfig(max_num_seqs=4, kv_cache_mb=8, prefill_chunk_size=256, max_length=1024)
    backend = EngineBackend(ClefDecider(make_release(seed=3), max_length=config.max_length), config,
                            "clef-fuzz")
    with TestClient(create_app(backend, config), raise_server_exceptions=False) as client:
        yield client, backend


def test_real_model_fuzzing_never_gets_a_5xx(real, strategies) -> None:
    client, backend = real
    strict, wild = strategies

    @settings(max_examples=80, **SETTINGS)
    @given(body=strict.of(request_schema(client.app)) | wild.of(request_schema(client.app)),
           path=st.sampled_from(ROUTES))
    def check(body: Any, path: str) -> None:
        response = send(client, body, path=path)
        assert response.status_code == 200 or response.status_code in CLIENT_ERRORS, response.text
        if response.status_code == 200:
            assert_answers(body, response)

    check()
    assert client.get("/health").status_code == 200
    response = send(client, GOOD)
    assert response.status_code == 200
    assert_answers(GOOD, response)
    stats = backend.stats()
    assert stats["failed"] == 0 and stats["finished"] > 0
    assert (stats["running"], stats["waiting"]) == (0, 0)
    # blocks are free, or kept by the prefix cache alone (evictable), never held for a finished sequence
    cached = stats.get("prefix_blocks_cache_only", 0)
    assert stats["kv_blocks_free"] + cached == stats["kv_blocks_total"]
    assert stats["gdn_slots_free"] == stats["gdn_slots_total"]

"""Workers AI's routes and envelope, OpenRouter's paths, and the documented shape of routing errors, with a
fake backend: the adapters call the one System One handler, so every answer and refusal is the System One
route's, translated."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clefserve.config import EngineConfig
from clefserve.engine.errors import QueueFullError
from clefserve.errors import RequestError
from clefserve.server import create_app
from tests.http_fakes import FakeBackend

KEY = "cf-token"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"state": {"message": "charged twice"},
        "questions": {"billing": {"type": "noul"},
                      "team": {"type": "choice", "criteria": {"billing": None, "sales": None}}}}
LONG = "/client/v4/accounts/0123abcd/ai/run/@cf/cloudflare/clef-flash"
ENCODED = "/client/v4/accounts/0123abcd/ai/run/@cf%2Fcloudflare%2Fclef-flash"  # what the cloudflare SDK sends
SHORT = "/ai/run/@cf/cloudflare/clef"


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(name="my-clef")


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[TestClient]:
    app = create_app(backend, EngineConfig(api_key=KEY, max_body_bytes=4096))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def assert_envelope_error(response, status: int, code: int, needle: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["success"] is False and body["result"] is None and body["messages"] == []
    assert [e["code"] for e in body["errors"]] == [code] * len(body["errors"]) and body["errors"]
    assert needle.lower() in " | ".join(e["message"] for e in body["errors"]).lower(), body


@pytest.mark.parametrize("path", [LONG, ENCODED, SHORT, "/ai/run/@cf/cloudflare/my-clef"])
def test_the_answer_is_the_system_one_answer_in_the_envelope(client: TestClient, backend: FakeBackend,
                                                             path: str) -> None:
    direct = client.post("/v1/systemone", json={"model": "x", **BODY}, headers=AUTH).json()
    response = client.post(path, json=BODY, headers=AUTH)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True and body["errors"] == [] and body["messages"] == []
    model = "@cf/cloudflare/" + path.rsplit("/", 1)[-1].rsplit("%2F", 1)[-1]
    assert body["result"] == {**direct, "model": model}
    assert backend.bodies[-1]["model"] == model  # the model comes from the path
    assert response.headers["x-request-id"]


def test_a_model_in_the_body_is_overridden_by_the_path(client: TestClient, backend: FakeBackend) -> None:
    response = client.post(SHORT, json={"model": "jev-latest", **BODY}, headers=AUTH)
    assert response.json()["result"]["model"] == "@cf/cloudflare/clef"
    assert list(backend.bodies[-1]) == ["model", "state", "questions"]  # key order kept


@pytest.mark.parametrize("path", ["/api/alpha/decisions", "/api/v1/systemone"])
def test_openrouter_paths_serve_the_system_one_body_unchanged(client: TestClient, path: str) -> None:
    body = {"model": "typesafe/jev-1.13", **BODY}
    response = client.post(path, json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.json() == client.post("/v1/systemone", json=body, headers=AUTH).json()
    assert client.post(path, json=body).status_code == 401  # the same guard


def test_envelope_errors(client: TestClient, backend: FakeBackend) -> None:
    assert_envelope_error(client.post(LONG, json=BODY), 401, 10000, "missing API key")
    assert_envelope_error(client.post(LONG, json=BODY, headers={"Authorization": "Bearer no"}), 401, 10000,
                          "invalid API key")
    assert_envelope_error(client.post(SHORT, json={"state": 1}, headers=AUTH), 400, 5006,
                          "body.questions: Field required")
    bad_level = {**BODY, "questions": {"q": {"type": "score", "criteria": ["low", None]}}}
    assert_envelope_error(client.post(SHORT, json=bad_level, headers=AUTH), 400, 5006,
                          "body.questions.q.score.criteria.1: a score level must be a string")
    assert_envelope_error(client.post(SHORT, content=b"{not json", headers=AUTH), 400, 5006, "JSON decode")
    assert_envelope_error(client.post(SHORT, json={**BODY, "state": "x" * 5000}, headers=AUTH), 413, 3006,
                          "--max-body-bytes")
    box = {**BODY, "questions": {"dog": {"type": "box", "instructions": "the dog"}}}
    assert_envelope_error(client.post(SHORT, json=box, headers=AUTH), 400, 5006,
                          "cannot answer question 'dog'")
    for path in ("/ai/run/@cf/cloudflare/llama-3", "/client/v4/accounts/a/ai/run/@cf/meta/llama-3.1-8b",
                 "/client/v4/accounts/a/ai/run/@cf%2Fmeta%2Fllama"):
        assert_envelope_error(client.post(path, json=BODY, headers=AUTH), 400, 5007, "No such model")
    assert_envelope_error(client.post("/client/v4/accounts/a/ai/models", json=BODY, headers=AUTH), 404, 7000,
                          "no route")
    assert_envelope_error(client.get(SHORT, headers=AUTH), 405, 7001, "allowed: POST")

    backend.fail_with = QueueFullError("the server is busy (--max-queue 2)", retry_after=3)
    busy = client.post(SHORT, json=BODY, headers=AUTH)
    assert_envelope_error(busy, 429, 3040, "--max-queue")
    assert busy.headers["retry-after"] == "3"
    backend.fail_with = RequestError("the model is not ready: loading", 503, "unavailable")
    assert_envelope_error(client.post(SHORT, json=BODY, headers=AUTH), 503, 3043, "not ready")
    backend.fail_with = RuntimeError("boom")
    assert_envelope_error(client.post(SHORT, json=BODY, headers=AUTH), 500, 5000, "internal server error")


def test_routing_errors_use_the_documented_shape(client: TestClient) -> None:
    missing = client.post("/v1/systemones", json={})
    assert missing.status_code == 404
    message = "no route POST /v1/systemones; GET /openapi.json lists the routes"
    assert missing.json() == {"detail": {"message": message, "error_type": "not_found"}}
    wrong = client.get("/v1/systemone")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["detail"] == {"message": "GET is not allowed on /v1/systemone; allowed: POST",
                                      "error_type": "method_not_allowed"}
    assert client.post("/health").json()["detail"]["error_type"] == "method_not_allowed"


def test_openapi_documents_the_adapters(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/{model}",
                 "/ai/run/@cf/cloudflare/{model}", "/api/alpha/decisions", "/api/v1/systemone"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/SystemOneRequest"}


def test_metrics_count_the_adapters_by_route_template(client: TestClient) -> None:
    client.post(ENCODED, json=BODY, headers=AUTH)
    client.post("/ai/run/@cf/cloudflare/nope", json=BODY, headers=AUTH)
    client.post("/ai/run/@cf/meta/llama", json=BODY, headers=AUTH)
    metrics = client.get("/metrics").text
    assert ('route="/client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/{model}",status="200"' in metrics)
    assert 'route="/ai/run/@cf/cloudflare/{model}",status="400"' in metrics
    assert 'route="/ai/run/{model:path}",status="400"' in metrics
    assert "0123abcd" not in metrics  # account ids never become label values


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([LONG, ENCODED, SHORT, "/ai/run/@cf/cloudflare/x%2F..%2F", "/ai/run/%40cf"]),
       payload=st.one_of(json_values, st.fixed_dictionaries({}, optional={
           "model": json_values, "state": json_values,
           "questions": st.dictionaries(st.text(max_size=5), json_values | st.fixed_dictionaries(
               {"type": st.sampled_from(["noul", "choice", "score", "box", "predict"])},
               optional={"criteria": json_values, "instructions": json_values}), max_size=3)})),
       auth=st.booleans())
def test_no_body_on_the_envelope_routes_gets_a_5xx(client: TestClient, path: str, payload: Any,
                                                   auth: bool) -> None:
    response = client.post(path, content=json.dumps(payload).encode(), headers=AUTH if auth else {})
    assert response.status_code < 500, response.text
    body = response.json()
    assert set(body) == {"success", "result", "errors", "messages"}, body
    assert body["success"] is (response.status_code == 200)

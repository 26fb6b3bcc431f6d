"""Routes besides validation: models, health, readiness, auth, request ids, backend errors, OpenAPI."""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from clefserve.config import EngineConfig
from clefserve.errors import RequestError
from clefserve.server import create_app
from tests.http_fakes import FakeBackend

REQUEST = {"model": "jev-latest", "state": "I was charged twice.",
           "questions": {"billing": {"type": "noul", "instructions": "Is this about billing?"}}}
KEY = "s3cret-key"
OCT_1_2026 = int(dt.datetime(2026, 10, 1, tzinfo=dt.UTC).timestamp())


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend, EngineConfig()), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def secured(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend, EngineConfig(api_key=KEY)), raise_server_exceptions=False) as c:
        yield c


def test_models_lists_typesafe_and_openai_shapes(client: TestClient) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["models"] == [{"name": "fake-clef", "description": "a fake model for tests",
                               "release_date": "2026-10-01", "x_confidence": "clef",
                               "x_question_ids": "prompt", "x_question_types": ["noul", "choice", "score"]}]
    assert body["object"] == "list"
    assert body["data"] == [{"id": "fake-clef", "object": "model", "created": OCT_1_2026,
                             "owned_by": "clef-serve"}]


def test_health_is_always_ok(client: TestClient, backend: FakeBackend) -> None:
    backend.readiness = (False, "loading the model")
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_ready_follows_the_backend(client: TestClient, backend: FakeBackend) -> None:
    backend.readiness = (False, "canary disagreed with the reference")
    response = client.get("/ready")
    assert response.status_code == 503
    assert response.json() == {"status": "not_ready", "reason": "canary disagreed with the reference"}
    backend.readiness = (True, "ready")
    response = client.get("/ready")
    assert response.status_code == 200
    assert response.json()["status"] == "ready"


def test_ready_is_503_when_the_check_itself_fails(client: TestClient, backend: FakeBackend) -> None:
    def broken() -> tuple[bool, str]:
        raise RuntimeError("device lost")

    backend.ready = broken  # type: ignore[method-assign]
    response = client.get("/ready")
    assert response.status_code == 503
    assert "device lost" in response.json()["reason"]


@pytest.mark.parametrize("authorization", [None, "Bearer anything", "Basic dXNlcjpwYXNz", "garbage"])
def test_without_api_key_authorization_is_ignored(client: TestClient, authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    assert client.post("/v1/systemone", json=REQUEST, headers=headers).status_code == 200
    assert client.get("/v1/models", headers=headers).status_code == 200


@pytest.mark.parametrize(("authorization", "needle"), [
    (None, "missing"),
    ("Bearer wrong-key", "invalid"),
    (f"Bearer {KEY}x", "invalid"),
    (f"Basic {KEY}", "missing"),
    (KEY, "missing"),
    ("Bearer ключ".encode(), "invalid"),
])
def test_api_key_refusals(secured: TestClient, backend: FakeBackend, authorization: str | bytes | None,
                          needle: str) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    for response in (secured.post("/v1/systemone", json=REQUEST, headers=headers),
                     secured.get("/v1/models", headers=headers)):
        assert response.status_code == 401
        detail = response.json()["detail"]
        assert detail["error_type"] == "authentication_error"
        assert needle in detail["message"]
        assert response.headers["www-authenticate"] == "Bearer"
    assert backend.bodies == []


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_api_key_accepted(secured: TestClient, scheme: str) -> None:
    headers = {"Authorization": f"{scheme} {KEY}"}
    assert secured.post("/v1/systemone", json=REQUEST, headers=headers).status_code == 200
    assert secured.get("/v1/models", headers=headers).status_code == 200


def test_health_and_ready_need_no_key(secured: TestClient) -> None:
    assert secured.get("/health").status_code == 200
    assert secured.get("/ready").status_code == 200


def test_auth_is_checked_before_the_body(secured: TestClient) -> None:
    response = secured.post("/v1/systemone", content=b"not json")
    assert response.status_code == 401


def test_request_id_is_generated(client: TestClient, backend: FakeBackend) -> None:
    first = client.post("/v1/systemone", json=REQUEST)
    second = client.post("/v1/systemone", json=REQUEST)
    ids = [r.headers["x-request-id"] for r in (first, second)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert ids[0] != ids[1]
    assert [r.headers["x-typesafe-request-id"] for r in (first, second)] == ids
    assert backend.request_ids == ids


def test_request_id_is_echoed(client: TestClient, backend: FakeBackend) -> None:
    response = client.post("/v1/systemone", json=REQUEST, headers={"x-request-id": "trace-42.a:b"})
    assert response.headers["x-request-id"] == "trace-42.a:b"
    assert backend.request_ids == ["trace-42.a:b"]


@pytest.mark.parametrize("unsafe", ["has space", "x" * 129, "semi;colon", ""])
def test_unsafe_request_id_is_replaced(client: TestClient, unsafe: str) -> None:
    response = client.get("/health", headers={"x-request-id": unsafe})
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])


@pytest.mark.parametrize(("method", "path", "status"), [
    ("POST", "/v1/systemone", 422), ("GET", "/nope", 404), ("GET", "/health", 200),
    ("GET", "/v1/models", 200),
])
def test_every_response_has_a_request_id(client: TestClient, method: str, path: str, status: int) -> None:
    response = client.request(method, path, content=b"{}")
    assert response.status_code == status
    assert response.headers["x-request-id"] == response.headers["x-typesafe-request-id"]


def test_unknown_path_is_404_in_the_documented_shape(client: TestClient) -> None:
    response = client.get("/v2/whatever")
    assert response.status_code == 404
    assert response.json() == {"detail": {"message": "no route GET /v2/whatever; GET /openapi.json lists the "
                                                     "routes", "error_type": "not_found"}}


def test_request_error_keeps_its_status(client: TestClient, backend: FakeBackend) -> None:
    backend.fail_with = RequestError("schema requires 40000 tokens before state; maximum is 16384",
                                     status=413, error_type="tokens_exceeded")
    response = client.post("/v1/systemone", json=REQUEST)
    assert response.status_code == 413
    message = "schema requires 40000 tokens before state; maximum is 16384"
    assert response.json() == {"detail": {"message": message, "error_type": "tokens_exceeded"}}


def test_request_error_default_is_422(client: TestClient, backend: FakeBackend) -> None:
    backend.fail_with = RequestError("billing: instructions render to no tokens")
    response = client.post("/v1/systemone", json=REQUEST)
    assert response.status_code == 422
    assert response.json()["detail"]["error_type"] == "invalid_request"


def test_unexpected_backend_error_is_500_and_logged(client: TestClient, backend: FakeBackend,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    backend.fail_with = ZeroDivisionError("boom")
    with caplog.at_level(logging.ERROR):
        response = client.post("/v1/systemone", json=REQUEST)
    assert response.status_code == 500
    request_id = response.headers["x-request-id"]
    detail = response.json()["detail"]
    assert detail["error_type"] == "unknown"
    assert request_id in detail["message"]
    assert "boom" not in detail["message"]
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None


def test_non_json_backend_answer_is_500(client: TestClient, backend: FakeBackend) -> None:
    async def nan_answer(*_: Any) -> dict[str, Any]:
        return {"model": "m", "answers": {"billing": {"type": "noul", "noul": float("nan")}}, "usage": {}}

    backend.decide = nan_answer  # type: ignore[method-assign]
    response = client.post("/v1/systemone", json=REQUEST)
    assert response.status_code == 500
    assert response.json()["detail"]["error_type"] == "unknown"


def test_openapi_documents_the_contract(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for name in ("SystemOneRequest", "ChoiceQuestion", "ScoreQuestion", "NoulQuestion", "SystemOneResponse",
                 "ModelList", "HTTPValidationError", "ErrorResponse"):
        assert name in components
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', str(schema).replace("'", '"')))
    assert refs <= components.keys()
    post = schema["paths"]["/v1/systemone"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/SystemOneRequest")
    assert {"200", "413", "422", "500"} <= post["responses"].keys()
    score = components["ScoreQuestion"]["properties"]["criteria"]
    assert (score["minItems"], score["maxItems"]) == (2, 10)
    # the extensions the server may add are documented too
    assert "x_cached_tokens" in components["Usage"]["properties"]
    for answer in ("NoulAnswer", "ChoiceAnswer", "ScoreAnswer"):
        assert "x_probabilities" in components[answer]["properties"]


def test_openapi_lists_bearer_auth_when_a_key_is_set(secured: TestClient) -> None:
    schema = secured.get("/openapi.json").json()
    assert "HTTPBearer" in schema["components"]["securitySchemes"]

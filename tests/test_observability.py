"""GET /metrics (open, per-app registry, engine gauges at scrape time) and the JSON logs with request ids."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from clefserve.config import EngineConfig
from clefserve.engine import QueueFullError
from clefserve.server import create_app
from clefserve.server.logging import JsonFormatter, RequestIdFilter, configure_json_logging
from tests.http_fakes import FakeBackend

REQUEST = {"model": "m", "state": "SECRET-STATE-4711", "questions": {"q": {"type": "noul"}}}


def samples(client: TestClient) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class LoggingBackend(FakeBackend):
    async def decide(self, body: dict[str, Any], request_id: str,
                     is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        logging.getLogger("clefserve.test").info("deciding")
        await asyncio.to_thread(logging.getLogger("clefserve.test").info, "in a worker thread")
        return await super().decide(body, request_id, is_disconnected)


@pytest.fixture
def backend() -> FakeBackend:
    return LoggingBackend()


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend, EngineConfig(api_key="k")), raise_server_exceptions=False) as c:
        yield c


def test_metrics_are_open_and_count_requests_by_route_template(client: TestClient) -> None:
    auth = {"Authorization": "Bearer k"}
    assert client.post("/v1/systemone", json=REQUEST, headers=auth).status_code == 200
    assert client.post("/v1/systemone", json=REQUEST).status_code == 401
    assert client.post("/v1/systemone", content=b"{", headers=auth).status_code == 422
    assert client.get("/no/such/path/123").status_code == 404
    assert client.get("/health").status_code == 200
    s = samples(client)  # no key needed
    assert s['clef_http_requests_total{method="POST",route="/v1/systemone",status="200"}'] == 1
    assert s['clef_http_requests_total{method="POST",route="/v1/systemone",status="401"}'] == 1
    assert s['clef_http_requests_total{method="POST",route="/v1/systemone",status="422"}'] == 1
    assert s['clef_http_requests_total{method="GET",route="other",status="404"}'] == 1  # no raw paths
    assert s['clef_http_request_duration_seconds_count{route="/v1/systemone"}'] == 3
    assert s["clef_model_ready"] == 1
    assert "process_resident_memory_bytes" in s
    assert not any(k.startswith("clef_engine_") for k in s)  # a backend without stats()
    assert "/metrics" not in client.get("/openapi.json").json()["paths"]


def test_each_app_has_its_own_registry(backend: FakeBackend) -> None:
    first, second = create_app(backend, EngineConfig()), create_app(backend, EngineConfig())
    with TestClient(first) as a, TestClient(second) as b:
        a.get("/health")
        assert samples(a)['clef_http_requests_total{method="GET",route="/health",status="200"}'] == 1
        assert 'clef_http_requests_total{method="GET",route="/health",status="200"}' not in samples(b)


def test_429_carries_retry_after_and_is_counted(client: TestClient, backend: FakeBackend) -> None:
    backend.fail_with = QueueFullError("the server is busy", retry_after=7)
    response = client.post("/v1/systemone", json=REQUEST, headers={"Authorization": "Bearer k"})
    assert response.status_code == 429 and response.headers["retry-after"] == "7"
    assert response.json()["detail"]["error_type"] == "overloaded"
    s = samples(client)
    assert s['clef_request_errors_total{error_type="overloaded"}'] == 1
    assert s['clef_http_requests_total{method="POST",route="/v1/systemone",status="429"}'] == 1


def test_engine_gauges_and_latency_histograms(make_release) -> None:
    from clefserve.formats.clef import ClefDecider
    from clefserve.formats.clef.engine_backend import EngineBackend

    config = EngineConfig(max_num_seqs=2, kv_cache_mb=4, max_length=1024)
    backend = EngineBackend(ClefDecider(make_release(seed=3), max_length=1024), config, "clef-metrics")
    with TestClient(create_app(backend, config)) as client:
        for i in range(3):
            assert client.post("/v1/systemone", json={**REQUEST, "state": f"state {i}"}).status_code == 200
        s = samples(client)
    stats = backend.engine.stats()
    assert s["clef_engine_running_sequences"] == 0 and s["clef_engine_waiting_sequences"] == 0
    assert s["clef_engine_kv_blocks_used"] == 0 and s["clef_engine_gdn_slots_used"] == 0
    assert s["clef_engine_kv_blocks_total"] == stats["kv_blocks_total"] > 0
    assert s["clef_engine_gdn_slots_total"] == 2
    assert s["clef_engine_prefill_tokens_total"] > 0
    assert s['clef_engine_sequences_total{outcome="finished"}'] == 3
    assert s["clef_request_queue_wait_seconds_count"] == 3
    assert s["clef_request_compute_seconds_count"] == 3
    assert s["clef_request_compute_seconds_sum"] > 0


def capture_json_logs() -> tuple[io.StringIO, logging.Handler]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    logger = logging.getLogger("clefserve")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return stream, handler


def test_json_logs_carry_the_request_id_and_never_the_body(client: TestClient) -> None:
    stream, handler = capture_json_logs()
    try:
        response = client.post("/v1/systemone", json=REQUEST,
                               headers={"Authorization": "Bearer k", "x-request-id": "trace-1"})
    finally:
        logging.getLogger("clefserve").removeHandler(handler)
    assert response.status_code == 200
    text = stream.getvalue()
    assert "SECRET-STATE-4711" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert all({"ts", "level", "logger", "msg"} <= line.keys() for line in lines)
    assert all(line["ts"].endswith("Z") for line in lines)
    mine = {line["msg"]: line for line in lines if line.get("request_id") == "trace-1"}
    assert {"deciding", "in a worker thread"} <= mine.keys()
    access = next(line for line in lines if line["logger"] == "clefserve.access")
    assert (access["method"], access["path"], access["status"]) == ("POST", "/v1/systemone", 200)
    assert access["request_id"] == "trace-1" and access["duration_ms"] >= 0


def test_json_lines_outside_requests_and_with_tracebacks() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_json_logging("info", stream)
        logging.getLogger("clefserve.x").info("hello %s", "world", extra={"blocks": 3})
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("uvicorn.error").exception("failed")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "hello world" and first["blocks"] == 3 and "request_id" not in first
    assert second["level"] == "ERROR" and second["logger"] == "uvicorn.error"
    assert "ValueError: boom" in second["exc"]

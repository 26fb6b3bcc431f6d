"""The FastAPI application: System One, model list, liveness and readiness routes."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from clefserve import __version__
from clefserve.config import EngineConfig
from clefserve.errors import RequestError
from clefserve.server.auth import bearer_guard
from clefserve.server.backend import DecisionBackend
from clefserve.server.body import decode_body, parse_json, read_body, validated_request
from clefserve.server.draining import CancelledRequestGuard
from clefserve.server.errors import error_detail, from_request_error
from clefserve.server.metrics import CONTENT_TYPE, Metrics, MetricsMiddleware
from clefserve.server.protocol import (
    ErrorResponse,
    HealthResponse,
    HTTPValidationError,
    ModelList,
    ReadyResponse,
    SystemOneRequest,
    SystemOneResponse,
)
from clefserve.server.request_id import RequestIdMiddleware

log = logging.getLogger(__name__)

DESCRIPTION = (
    "System One decision API (`POST /v1/systemone`) for Clef decision models, compatible with the "
    "TypeSafe SDKs. Bad requests get a 4xx, never a 5xx."
)
# Larger bodies are parsed off the event loop, so that probes and small requests are not held up.
PARSE_IN_THREAD_BYTES = 64 * 1024
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "Missing or wrong API key (only with --api-key)"},
    413: {"model": ErrorResponse, "description": "Body larger than --max-body-bytes"},
    415: {"model": ErrorResponse, "description": "Unsupported Content-Encoding or multipart body"},
    422: {"model": HTTPValidationError,
          "description": "Malformed JSON or an invalid request; loc names the field"},
    500: {"model": ErrorResponse, "description": "Unexpected server error (logged with the request id)"},
    503: {"model": ErrorResponse, "description": "The model is not ready"},
}


def _created(release_date: str) -> int:
    """OpenAI's ``created`` (Unix seconds) from a YYYY-MM-DD release date."""
    try:
        day = dt.date.fromisoformat(release_date)
    except (TypeError, ValueError):
        return 0
    return int(dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC).timestamp())


def model_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    data = [{"id": c["name"], "object": "model", "created": _created(c["release_date"]),
             "owned_by": "clef-serve"} for c in cards]
    return {"models": cards, "object": "list", "data": data}


async def _read_request(request: Request, config: EngineConfig) -> Any:
    content_type = request.headers.get("content-type", "")
    if content_type.lower().startswith("multipart/"):
        raise HTTPException(415, error_detail(
            "multipart bodies (image assets) are not supported: send the request as application/json",
            "invalid_request"))
    raw = await read_body(request.stream(), request.headers.get("content-length"), config.max_body_bytes)
    raw = decode_body(raw, request.headers.get("content-encoding"), config.max_body_bytes)
    if len(raw) > PARSE_IN_THREAD_BYTES:  # a 1 MiB body takes ~0.2 s to parse and check
        return await run_in_threadpool(parse_json, raw)
    return parse_json(raw)


def _metrics_for(backend: DecisionBackend) -> Metrics:
    """Metrics reading the backend's optional ``stats()``; handed to its optional ``bind_metrics()``."""

    def ready() -> bool:
        return bool(backend.ready()[0])

    metrics = Metrics(getattr(backend, "stats", None), ready)
    bind = getattr(backend, "bind_metrics", None)
    if bind is not None:
        bind(metrics)
    return metrics


def create_app(backend: DecisionBackend, config: EngineConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        start = getattr(backend, "start", None)
        if start is not None:
            await start()
        try:
            yield
        finally:
            stop = getattr(backend, "stop", None)
            if stop is not None:
                await stop()

    app = FastAPI(title="clef-serve", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    metrics = _metrics_for(backend)
    app.state.metrics = metrics
    app.add_middleware(CancelledRequestGuard)  # innermost: metrics and the access log see its 503
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so every log line has the id
    guard = [Depends(bearer_guard(config.api_key))] if config.api_key else []

    @app.post(
        "/v1/systemone", dependencies=guard, response_model=None,
        responses={200: {"model": SystemOneResponse}, **_ERRORS},
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/SystemOneRequest"}}}}},
        summary="Answer questions about a state",
    )
    async def systemone(request: Request) -> JSONResponse:
        body = validated_request(await _read_request(request, config))
        request_id: str = request.state.request_id
        try:
            # The body as parsed, not a model dump: key order and 1 vs 1.0 reach the tokens.
            result = await backend.decide(body, request_id, request.is_disconnected)
            return JSONResponse(result)
        except RequestError as exc:
            metrics.count_error(exc.error_type)
            raise from_request_error(exc) from None
        except HTTPException:
            raise
        except Exception:
            metrics.count_error("internal")
            log.exception("decision failed, request_id=%s", request_id)
            raise HTTPException(500, error_detail(
                f"internal server error; the server log has the details (request id {request_id})",
                "unknown")) from None

    @app.get("/v1/models", dependencies=guard, response_model=ModelList, responses={401: _ERRORS[401]},
             summary="The served model, in TypeSafe's and OpenAI's shapes")
    async def models() -> dict[str, Any]:
        return model_list(backend.model_cards())

    @app.get("/health", response_model=HealthResponse, summary="Liveness: the process answers")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", response_model=ReadyResponse, responses={503: {"model": ReadyResponse}},
             summary="Readiness: the model is loaded and checked")
    async def ready() -> JSONResponse:
        try:
            ok, reason = backend.ready()
        except Exception as exc:
            log.exception("backend.ready() failed")
            ok, reason = False, f"readiness check failed: {type(exc).__name__}: {exc}"
        return JSONResponse({"status": "ready" if ok else "not_ready", "reason": reason},
                            status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        """Prometheus text format; open like /health (no key), so scrapers need no secret."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            request_schema = SystemOneRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(request_schema.pop("$defs", {}))
            components["SystemOneRequest"] = request_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app

"""The FastAPI application: System One (and the same handler under OpenRouter's and Workers AI's paths),
model list, liveness and readiness routes."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from clefserve import __version__
from clefserve.config import EngineConfig
from clefserve.errors import RequestError
from clefserve.server import workers_ai
from clefserve.server.assets import (
    IMAGE_ASSET_SCHEMA,
    MULTIPART_CONTENT,
    Multipart,
    is_multipart,
    parse_multipart,
    renamed,
    resolve_assets,
)
from clefserve.server.auth import bearer_guard
from clefserve.server.backend import DecisionBackend, question_types
from clefserve.server.body import (
    WITH_IMAGES,
    check_text_size,
    decode_body,
    parse_json,
    read_body,
    too_large,
    validated_request,
)
from clefserve.server.console import add_console_routes
from clefserve.server.draining import CancelledRequestGuard
from clefserve.server.errors import error_detail, from_request_error, routing_error
from clefserve.server.limits import RequestLimits
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
from clefserve.server.status import StatusReporter, StatusResponse

log = logging.getLogger(__name__)

DESCRIPTION = (
    "System One decision API (`POST /v1/systemone`) for Clef decision models, compatible with the "
    "TypeSafe SDKs. Bad requests get a 4xx, never a 5xx."
)
# Larger bodies are parsed off the event loop, so that probes and small requests are not held up.
PARSE_IN_THREAD_BYTES = 64 * 1024
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "Missing or wrong API key (only with --api-key)"},
    413: {"model": ErrorResponse,
          "description": "Body larger than --max-body-bytes (not counting images), an image larger than "
                         "--max-image-bytes or --max-image-pixels"},
    415: {"model": ErrorResponse,
          "description": "Unsupported Content-Encoding, a multipart type other than form-data, or an image "
                         "part whose Content-Type is not an image"},
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


# What the OpenAPI document says `confidence` is, per --confidence.
CONFIDENCE_DESCRIPTIONS = {
    "clef": "Confidence in force on this server (--confidence clef, Cloudflare's reference): the probability "
            "of the chosen label (choice) or of the most probable level (score), rounded to 4 decimals.",
    "typesafe": "Confidence in force on this server (--confidence typesafe, TypeSafe's definition), from "
                "the unrounded probabilities renormalised to sum 1: choice (m - 1/n) / (1 - 1/n) for top "
                "probability m over n labels; score max(0, 1 - sum_i p_i |i - k| / D) for mode k, with D the "
                "mean absolute deviation of a uniform answer over the n levels; 1 when n = 1; rounded to 4 "
                "decimals.",
}
QUESTION_ID_DESCRIPTIONS = {
    "prompt": "On this server (--question-ids prompt, Cloudflare's encoding) each id "
              "is written into the model's record, so renaming a question can change its answer.",
    "opaque": "On this server (--question-ids opaque) ids never reach the model: the "
              "record names the questions q1, q2, ... by position; answers come back under the ids sent.",
}


def semantics_card(config: EngineConfig) -> dict[str, str]:
    """Extension fields of each /v1/models card: the semantics flags in force."""
    return {"x_confidence": config.confidence, "x_question_ids": config.question_ids}


def model_list(cards: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``extra``: fields added to every TypeSafe card (extensions, prefixed ``x_``)."""
    cards = [{**card, **(extra or {})} for card in cards]
    data = [{"id": c["name"], "object": "model", "created": _created(c["release_date"]),
             "owned_by": "clef-serve"} for c in cards]
    return {"models": cards, "object": "list", "data": data}


def body_limit(config: EngineConfig, backend: DecisionBackend) -> int:
    """--max-body-bytes, plus room for --max-images base64 images unless the model takes none."""
    takes_images = getattr(backend, "takes_images", None)
    if config.max_images <= 0 or (takes_images is not None and takes_images() is False):
        return config.max_body_bytes
    return config.max_body_bytes + config.image_body_bytes


async def _read_request(request: Request, config: EngineConfig, limit: int) -> tuple[Any, Multipart | None]:
    """The parsed JSON body, and for a multipart/form-data body (TypeSafe's image assets) its image parts."""
    content_type = request.headers.get("content-type", "")
    what = "--max-body-bytes" if limit == config.max_body_bytes else WITH_IMAGES
    raw = await read_body(request.stream(), request.headers.get("content-length"), limit, what)
    raw = decode_body(raw, request.headers.get("content-encoding"), limit, what)
    multipart = None
    if is_multipart(content_type):
        multipart = parse_multipart(raw, content_type, config.max_images + 1)
        raw = multipart.request
    if len(raw) > config.max_body_bytes and b'"images"' not in raw and b'"assets"' not in raw:
        raise too_large(config.max_body_bytes)  # no pictures: refuse before parsing
    if len(raw) > PARSE_IN_THREAD_BYTES:  # a 1 MiB body takes ~0.2 s to parse and check
        body = await run_in_threadpool(parse_json, raw)
    else:
        body = parse_json(raw)
    check_text_size(raw, body, config.max_body_bytes)
    return body, multipart


def _describe_semantics(components: dict[str, Any], config: EngineConfig) -> None:
    """State in the OpenAPI document which --confidence, --question-ids and limits this server runs with."""
    for answer in ("ChoiceAnswer", "ScoreAnswer"):
        properties = components.get(answer, {}).get("properties", {})
        if "confidence" in properties:
            properties["confidence"]["description"] = CONFIDENCE_DESCRIPTIONS[config.confidence]
    # the limits in force (--max-questions, --max-choice-labels, --max-score-levels)
    for schema, key, value in (("SystemOneRequest", "maxProperties", config.max_questions),
                               ("ChoiceQuestion", "maxProperties", config.max_choice_labels),
                               ("ScoreQuestion", "maxItems", config.max_score_levels)):
        field = "questions" if schema == "SystemOneRequest" else "criteria"
        properties = components.get(schema, {}).get("properties", {})
        if field in properties:
            properties[field][key] = value
    questions = components["SystemOneRequest"].get("properties", {}).get("questions")
    if questions is not None:
        questions["description"] = " ".join(
            filter(None, [questions.get("description"), QUESTION_ID_DESCRIPTIONS[config.question_ids]]))


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

    @app.exception_handler(StarletteHTTPException)
    async def http_errors(request: Request, exc: StarletteHTTPException) -> Response:
        """Routing's own 404 and 405 (a plain-text detail) in the documented error shape; the envelope on
        Workers AI paths."""
        if exc.status_code not in (404, 405) or not isinstance(exc.detail, str):
            return await http_exception_handler(request, exc)
        allow = (exc.headers or {}).get("Allow")
        body = routing_error(exc.status_code, request.method, request.url.path, allow)
        if request.url.path.startswith(workers_ai.PATH_PREFIXES):
            return workers_ai.error_response(exc.status_code, body["detail"], exc.headers)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    limits = RequestLimits(config.max_questions, config.max_choice_labels, config.max_score_levels)

    async def answer(request: Request, adapt: Callable[[Any], Any] | None = None,
                     wrap: Callable[[dict[str, Any]], Any] | None = None) -> JSONResponse:
        """The System One handler every decision route calls: body intake, validation, limits, the
        backend, the JSON answer. A route shaped like another service passes ``adapt`` (applied to the
        parsed body first) and ``wrap`` (applied to the answer)."""
        body, multipart = await _read_request(request, config, body_limit(config, backend))
        if adapt is not None:
            body = adapt(body)
        # TypeSafe's assets become images (the references in the text positional markers)
        pictures = resolve_assets(body, multipart, config.max_images, config.max_image_bytes)
        body = pictures.body
        validated_request(body, limits, question_types(backend))
        request_id: str = request.state.request_id
        try:
            # The body as parsed, not a model dump: key order and 1 vs 1.0 reach the tokens.
            result = await backend.decide(body, request_id, request.is_disconnected)
            return JSONResponse(wrap(result) if wrap is not None else result)
        except RequestError as exc:
            metrics.count_error(exc.error_type)
            raise from_request_error(renamed(exc, pictures.names)) from None
        except HTTPException:
            raise
        except Exception:
            metrics.count_error("internal")
            log.exception("decision failed, request_id=%s", request_id)
            raise HTTPException(500, error_detail(
                f"internal server error; the server log has the details (request id {request_id})",
                "unknown")) from None

    decision_route = {
        "dependencies": guard, "response_model": None,
        "responses": {200: {"model": SystemOneResponse}, **_ERRORS},
        "openapi_extra": {"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/SystemOneRequest"}},
            **MULTIPART_CONTENT}}},
    }

    @app.post("/v1/systemone", summary="Answer questions about a state", **decision_route)
    async def systemone(request: Request) -> JSONResponse:
        return await answer(request)

    # OpenRouter's paths: its decisions route, and /v1/systemone under its base URL .../api (where the
    # TypeSafe SDK points for OpenRouter), so such clients only change the host
    @app.post("/api/alpha/decisions", summary="OpenRouter's decisions path: the System One body and answer",
              **decision_route)
    @app.post("/api/v1/systemone", summary="/v1/systemone under OpenRouter's base URL (.../api)",
              **decision_route)
    async def decisions(request: Request) -> JSONResponse:
        return await answer(request)

    workers_ai.add_routes(app, answer, lambda: backend.model_cards()[0]["name"], guard,
                          {200: {"description": 'Cloudflare\'s envelope: {"success": true, "result": '
                                                '<the System One answer>, "errors": [], "messages": []}'},
                           **{status: {"description": f"{spec['description']}, in Cloudflare's envelope"}
                              for status, spec in _ERRORS.items()}})

    @app.get("/v1/models", dependencies=guard, response_model=ModelList, responses={401: _ERRORS[401]},
             summary="The served model, in TypeSafe's and OpenAI's shapes")
    async def models() -> dict[str, Any]:
        return model_list(backend.model_cards(),
                          {**semantics_card(config), "x_question_types": list(question_types(backend))})

    reporter = StatusReporter(backend, config, metrics)

    @app.get("/v1/status", dependencies=guard, response_model=None,
             responses={200: {"model": StatusResponse}, 401: _ERRORS[401]},
             summary="The engine at a glance: model, self-check, pools, prefix cache, the last minute")
    async def status() -> JSONResponse:
        """What the console's engine panel shows, read from the counters /metrics exports. Holds no paths,
        keys or environment."""
        return JSONResponse(reporter.report())

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
            components["ImageAsset"] = IMAGE_ASSET_SCHEMA
            _describe_semantics(components, config)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    if config.console:
        add_console_routes(app)
    return app

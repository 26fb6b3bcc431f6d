"""Cloudflare Workers AI's routes and envelope, as a thin adapter over the System One handler.

Code written for hosted Clef calls ``POST /client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/clef``
(or ``clef-flash``; the official ``cloudflare`` SDK sends the model name percent-encoded,
``@cf%2Fcloudflare%2Fclef-flash``, which the server decodes before routing) with the System One body, and
reads ``{"success": true, "result": {...}, "errors": [], "messages": []}``. This module only translates: the
model comes from the path, the body goes to the same handler as ``/v1/systemone`` (validation, limits, auth,
metrics and the engine exist once), the answer is wrapped, and every error, the auth guard's 401 included,
becomes ``{"success": false, "result": null, "errors": [{"code", "message"}], "messages": []}``.

Statuses are the System One route's, except bad input: Workers AI answers it 400, so a 422 becomes 400
(code 5006). Codes follow Workers AI's error table where one applies (5007 no such model, 3006 request too
large, 3040 out of capacity); the rest are this server's: 10000 authentication, 7000 no such route, 7001
method not allowed, 3043 not ready or shutting down, 5000 internal error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from clefserve.server.assets import MULTIPART_CONTENT

# The model names hosted Clef is called by; each maps to the served release.
WORKERS_AI_MODELS = ("clef", "clef-flash")
MODEL_PREFIX = "@cf/cloudflare/"
ROUTES = (
    "/client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/{model}",
    "/ai/run/@cf/cloudflare/{model}",
)
# Any other model on the same paths: Workers AI's "No such model" (400, code 5007).
OTHER_MODELS = ("/client/v4/accounts/{account_id}/ai/run/{model:path}", "/ai/run/{model:path}")
# Paths whose errors (even 404/405 from routing) are answered in the envelope.
PATH_PREFIXES = ("/client/v4/", "/ai/run/")

_CODES_BY_STATUS = {400: 5006, 401: 10000, 404: 7000, 405: 7001, 413: 3006, 415: 5006, 422: 5006, 429: 3040,
                    499: 3008, 503: 3043}


def envelope(result: Any) -> dict[str, Any]:
    return {"success": True, "result": result, "errors": [], "messages": []}


def _messages(detail: Any) -> list[str]:
    """The error messages of a System One error body's ``detail``."""
    if isinstance(detail, list):  # FastAPI validation items
        return [f"{'.'.join(str(p) for p in item.get('loc', []))}: {item.get('msg', '')}".lstrip(": ")
                for item in detail if isinstance(item, dict)] or ["invalid request"]
    if isinstance(detail, dict):
        return [str(detail.get("message", detail))]
    return [str(detail)]


def error_response(status: int, detail: Any, headers: dict[str, str] | None = None,
                   code: int | None = None) -> JSONResponse:
    """The envelope for an error the System One handler raised (its status and ``detail``)."""
    if status == 422:
        status = 400  # Workers AI answers bad input 400
    code = code or _CODES_BY_STATUS.get(status, 5000)
    body = {"success": False, "result": None,
            "errors": [{"code": code, "message": message} for message in _messages(detail)], "messages": []}
    return JSONResponse(body, status_code=status, headers=headers)


class EnvelopeRoute(APIRoute):
    """A route whose every answer is in the envelope: errors from dependencies (auth) and from the body
    are caught here, where the route's own code cannot see them."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handle = super().get_route_handler()

        async def enveloped(request: Request) -> Response:
            try:
                return await handle(request)
            except HTTPException as exc:
                return error_response(exc.status_code, exc.detail, exc.headers)
            except RequestValidationError as exc:
                return error_response(422, exc.errors())

        return enveloped


def no_such_model(model: str, served_name: str) -> JSONResponse:
    """Workers AI's answer for a model this server does not run: 400, code 5007."""
    names = ", ".join(f"{MODEL_PREFIX}{m}" for m in dict.fromkeys((*WORKERS_AI_MODELS, served_name)))
    return error_response(400, {"message": f"No such model {model[:200]}: this server runs {served_name}, "
                                           f"as {names}"}, code=5007)


def add_routes(
    app: FastAPI,
    answer: Callable[..., Awaitable[JSONResponse]],
    served_name: Callable[[], str],
    dependencies: list[Any],
    responses: dict[int | str, dict[str, Any]],
) -> None:
    """Register the Workers AI routes; ``answer(request, adapt, wrap)`` is the System One handler, which
    applies ``adapt`` to the parsed body before validation and ``wrap`` to the answer."""

    async def run(request: Request, model: str) -> JSONResponse:
        served = served_name()
        if model not in (*WORKERS_AI_MODELS, served):
            return no_such_model(MODEL_PREFIX + model, served)
        name = MODEL_PREFIX + model

        def from_path(body: Any) -> Any:
            # the model is the path's; a "model" in the body is overridden
            return {**body, "model": name} if isinstance(body, dict) else body

        return await answer(request, from_path, envelope)

    async def other_model(model: str) -> JSONResponse:
        return no_such_model(model, served_name())

    for path in ROUTES:
        app.router.add_api_route(
            path, run, methods=["POST"], dependencies=dependencies, route_class_override=EnvelopeRoute,
            response_model=None, responses=responses, tags=["Cloudflare Workers AI"],
            summary="Workers AI's run route for hosted Clef: the System One body, the answer in Cloudflare's "
                    "envelope",
            openapi_extra={"requestBody": {"required": True, "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/SystemOneRequest"}},
                **MULTIPART_CONTENT}}},
        )
    for path in OTHER_MODELS:  # after the routes above, which take precedence
        app.router.add_api_route(path, other_model, methods=["POST"], dependencies=dependencies,
                                 route_class_override=EnvelopeRoute, include_in_schema=False)

"""Request ids and one log line per request (pure ASGI, so request bodies still stream)."""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clefserve.server.limits import MAX_REQUEST_ID_LENGTH
from clefserve.server.logging import request_id_var

log = logging.getLogger("clefserve.access")

_VALID_ID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_LENGTH}}}")
# Probes and scrapers hit these every few seconds; their lines are logged at DEBUG only.
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
# x-request-id is the common name; the TypeSafe SDK reads x-typesafe-request-id.
RESPONSE_HEADERS = ("x-request-id", "x-typesafe-request-id")


def request_id_of(scope: Scope) -> str:
    """The client's x-request-id when it is a safe token, else a new uuid4 hex."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = value.decode("latin-1")
            if _VALID_ID.fullmatch(candidate):
                return candidate
            break
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Puts the id in ``request.state.request_id``, in the logging context and in the response headers, and
    writes one access log line per request (method, path, status, duration; never the body)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        status = 0
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                for name in RESPONSE_HEADERS:
                    headers[name] = request_id
            await send(message)

        token = request_id_var.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            status = status or 500  # Starlette's outermost middleware answers 500
            raise
        finally:
            duration_ms = round((time.perf_counter() - started) * 1000, 1)
            level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
            # status 0: no response was started (the client left, or the task was cancelled)
            log.log(level, "%s %s %s %.1fms", scope["method"], scope["path"], status or "-", duration_ms,
                    extra={"method": scope["method"], "path": scope["path"], "status": status,
                           "duration_ms": duration_ms, "request_id": request_id})
            request_id_var.reset(token)

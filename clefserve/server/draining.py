"""Requests cut off at shutdown get a JSON 503, not uvicorn's plain-text 500.

On SIGTERM uvicorn stops accepting and lets in-flight requests run for ``--shutdown-grace-s``; the request
tasks still running then are cancelled, and uvicorn would answer them ``500 Internal Server Error`` in
plain text. This middleware answers such a request ``503 {"detail": {"message", "error_type":
"unavailable"}}`` with ``Retry-After`` and ``Connection: close``: clients retry it (on another replica).
Nothing else in this app cancels request tasks (a client that disconnects is noticed by polling).
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

SHUTDOWN_BODY = json.dumps({"detail": {
    "message": "the server shut down before this request finished (shutdown grace period over); retry it",
    "error_type": "unavailable"}}).encode()


class CancelledRequestGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if started:
                raise
            log.warning("request cancelled before it was answered (shutdown); answering 503")
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(SHUTDOWN_BODY)).encode()),
                (b"retry-after", b"1"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": SHUTDOWN_BODY})

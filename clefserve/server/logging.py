"""Structured logs: one JSON object per line, with the request id of the request being served.

``{"ts": "2026-10-01T12:00:00.123Z", "level": "INFO", "logger": "clefserve.access", "msg": "...",
"request_id": "..."}``, plus any ``extra={...}`` fields of the call (the access log adds method, path,
status and duration_ms) and ``exc`` with the traceback of ``log.exception``. ``request_id`` comes from a
context variable that :class:`~clefserve.server.request_id.RequestIdMiddleware` sets for each request; it
follows the request into ``asyncio.to_thread`` and the thread pool, not onto the engine's thread.
Request bodies and states are never logged.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from contextvars import ContextVar
from typing import Any

request_id_var: ContextVar[str | None] = ContextVar("clef_request_id", default=None)

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is logged as a field.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "request_id", "color_message", "taskName",
}


class RequestIdFilter(logging.Filter):
    """Stamps ``record.request_id`` from the context (at the call site's thread, before formatting)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created, dt.UTC)
        out: dict[str, Any] = {
            "ts": ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            out["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_json_logging(level: str, stream: Any = None) -> logging.Handler:
    """Send every logger (ours, uvicorn's) through one JSON handler on stderr at ``level``."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        named = logging.getLogger(name)
        named.handlers.clear()
        named.propagate = True
    return handler

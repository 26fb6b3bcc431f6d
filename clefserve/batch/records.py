"""One input record of a batch: its id, its System One body, or the error the HTTP route would answer.

A record is checked by the HTTP route's own code (``server/body.py``): the ``--max-body-bytes`` bound (413;
a JSONL line with ``images`` may be larger by the images' allowance, as an HTTP body may),
strict JSON parsing and ``validated_request`` (422 with FastAPI's ``detail[]``). Its error therefore has the
status, message and detail a client of ``POST /v1/systemone`` would get for the same body.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException

from clefserve.errors import RequestError
from clefserve.server.body import WITH_IMAGES, check_text_size, parse_json, too_large, validated_request
from clefserve.server.limits import RequestLimits

ID_FIELD = "id"


@dataclass
class Item:
    """``id``: the record's own id, else its position (line or row number, from 1). ``body``: the parsed
    request (validated once :func:`validate` has run), or None when ``error`` says why it cannot be asked."""

    id: str | int
    position: int
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    size: int = 0  # bytes of its JSON text: what it costs to hold it in the lookahead

    @property
    def key(self) -> str:
        return id_key(self.id)


def id_key(value: str | int) -> str:
    """Ids are compared as text: ``5`` and ``"5"`` are the same record."""
    return str(value)


def error_from_http(exc: HTTPException) -> dict[str, Any]:
    """``{"status", "error_type", "message"}`` of an HTTP refusal; validation errors (a ``detail[]`` list)
    also carry ``detail``, exactly the list the HTTP route sends."""
    detail = exc.detail
    if isinstance(detail, list):
        message = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', []))}: {d.get('msg')}" for d in detail)
        return {"status": exc.status_code, "error_type": "invalid_request", "message": message,
                "detail": detail}
    if isinstance(detail, dict):
        return {"status": exc.status_code, "error_type": detail.get("error_type", "invalid_request"),
                "message": str(detail.get("message"))}
    return {"status": exc.status_code, "error_type": "invalid_request", "message": str(detail)}


def error_from_request(exc: RequestError) -> dict[str, Any]:
    return {"status": exc.status, "error_type": exc.error_type, "message": exc.message}


def _bad_id(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, str | int):
        return f"id must be a string or an integer, not {type(value).__name__}"
    if value == "":
        return "id must not be empty"
    return None


def id_error(position: int, message: str) -> Item:
    error = {"status": 422, "error_type": "invalid_request", "message": message}
    return Item(position, position, error=error)


def item_from_json(raw: bytes, position: int, limit: int, text_limit: int | None = None) -> Item:
    """A JSONL line: a ``/v1/systemone`` body with an optional ``id``; a line that cannot be read as one
    (too long, not JSON, not an object, a bad id) keeps its position as id. ``limit`` bounds the line;
    ``text_limit`` (--max-body-bytes, when ``limit`` makes room for images) bounds it without its images."""
    try:
        if len(raw) > limit:
            raise too_large(limit, WITH_IMAGES if text_limit is not None and limit > text_limit
                            else "--max-body-bytes")
        value = parse_json(raw)
        if text_limit is not None:  # a line read for its images whose text is too long: as if unread
            check_text_size(raw, value, text_limit)
    except HTTPException as exc:
        return Item(position, position, error=error_from_http(exc), size=len(raw))
    if isinstance(value, dict) and ID_FIELD in value:
        problem = _bad_id(value[ID_FIELD])
        if problem is not None:
            return id_error(position, problem)
        record_id = value[ID_FIELD]
    else:
        record_id = position
    return Item(record_id, position, body=value, size=len(raw))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    raise TypeError(f"a {type(value).__name__} value is not JSON")


def item_from_row(
    record_id: Any, position: int, state: Any, questions: Any, model: str, limit: int
) -> Item:
    """A table row (CSV, Parquet, a Ray batch): the body ``{"model", "state", "questions"}`` is written as
    JSON and read back through :func:`item_from_json`, so it meets exactly the checks a JSONL line does
    (NaN, size, depth...)."""
    if record_id is None:
        record_id = position
    problem = _bad_id(record_id)
    if problem is not None:
        return id_error(position, problem)
    try:
        text = json.dumps({"model": model, "state": state, "questions": questions}, ensure_ascii=False,
                          default=_jsonable)
    except (TypeError, ValueError, RecursionError) as exc:
        item = id_error(position, f"state is not a JSON value: {exc}")
        item.id = record_id
        return item
    item = item_from_json(text.encode("utf-8", "surrogatepass"), position, limit)
    item.id = record_id
    return item


def validate(
    item: Item, limits: RequestLimits | None = None, supported: tuple[str, ...] | None = None
) -> None:
    """Check a parsed body as the HTTP route does (``limits``: the flags' bounds; ``supported``: the question
    types the model answers); on failure ``item.error`` holds the 422."""
    if item.body is None:
        return
    try:
        validated_request(item.body, limits, supported)
    except HTTPException as exc:
        item.body, item.error = None, error_from_http(exc)

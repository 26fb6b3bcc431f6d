"""Error bodies: FastAPI's ``detail[]`` for validation, else ``{"detail": {"message", "error_type"}}``."""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException
from pydantic import ValidationError

from clefserve.errors import RequestError
from clefserve.server.limits import MAX_ECHOED_INPUT_CHARS


def error_detail(message: str, error_type: str) -> dict[str, str]:
    return {"message": message, "error_type": error_type}


def from_request_error(exc: RequestError) -> HTTPException:
    retry_after = getattr(exc, "retry_after", None)
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
    return HTTPException(exc.status, error_detail(exc.message, exc.error_type), headers=headers)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _small_input(value: Any) -> bool:
    try:
        return len(json.dumps(value, ensure_ascii=False)) <= MAX_ECHOED_INPUT_CHARS
    except (TypeError, ValueError, RecursionError):
        return False


# Pydantic messages that do not say what to send instead.
_MESSAGES = {
    "union_tag_not_found": "a question needs a \"type\": 'noul', 'choice' or 'score'",
    "model_attributes_type": "must be an object",
}


def validation_detail(exc: ValidationError) -> list[dict[str, Any]]:
    """Pydantic errors as FastAPI writes them, ``loc`` prefixed with "body"; large inputs are not echoed."""
    detail = []
    for err in exc.errors(include_url=False):
        message = _MESSAGES.get(err["type"], err["msg"])
        item: dict[str, Any] = {"type": err["type"], "loc": ["body", *err["loc"]], "msg": message}
        if "input" in err and _small_input(err["input"]):
            item["input"] = err["input"]
        if err.get("ctx"):
            item["ctx"] = {k: _jsonable(v) for k, v in err["ctx"].items()}
        detail.append(item)
    return detail


def validation_failed(exc: ValidationError) -> HTTPException:
    return HTTPException(422, validation_detail(exc))

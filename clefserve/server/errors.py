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


def unsupported_question_type(refused: list[tuple[str, str]], supported: tuple[str, ...]) -> HTTPException:
    """422 naming each question whose type the loaded model cannot answer, and the types it answers."""
    named = ", ".join(f"{qid!r} ({kind!r})" for qid, kind in refused[:8])
    more = f" and {len(refused) - 8} more" if len(refused) > 8 else ""
    noun = "question" if len(refused) == 1 else "questions"
    return HTTPException(422, error_detail(
        f"this model cannot answer {noun} {named}{more}: it answers {', '.join(supported)} questions "
        f"(GET /v1/models lists them as x_question_types)", "unsupported_question_type"))


def routing_error(status: int, method: str, path: str, allow: str | None) -> dict[str, Any]:
    """The documented error body for a 404 (no such route) or 405 (wrong method) from routing."""
    if status == 405:
        return {"detail": error_detail(f"{method} is not allowed on {path[:200]}; allowed: {allow or 'none'}",
                                       "method_not_allowed")}
    return {"detail": error_detail(f"no route {method} {path[:200]}; GET /openapi.json lists the routes",
                                   "not_found")}

"""Request body intake: size-bounded reading, content decoding, strict JSON parsing.

Every refusal is a ``fastapi.HTTPException`` with a 4xx status: bad input must never become a 5xx,
because clients retry those. JSON errors use FastAPI's ``detail[]`` shape with ``loc`` starting at "body".
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator
from typing import Any, NoReturn

from fastapi import HTTPException
from pydantic import ValidationError

from clefserve.server.decoding import ContentDecodingError, decode_content
from clefserve.server.errors import unsupported_question_type, validation_failed
from clefserve.server.limits import MAX_INTEGER_DIGITS, MAX_JSON_DEPTH, RequestLimits
from clefserve.server.protocol import SystemOneRequest, unsupported_questions

_SURROGATE = re.compile("[\ud800-\udfff]")


class _Rejected(ValueError):
    """A JSON text that parses but that this server refuses (raised from the json hooks)."""


def too_large(limit: int, what: str = "--max-body-bytes") -> HTTPException:
    return HTTPException(413, {"message": f"request body is larger than {limit} bytes ({what})",
                               "error_type": "request_too_large"})


async def read_body(stream: AsyncIterator[bytes], content_length: str | None, limit: int,
                    what: str = "--max-body-bytes") -> bytes:
    """The raw body, refused with 413 as soon as the declared or the received size passes ``limit``."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise HTTPException(400, {"message": "Content-Length is not an integer",
                                      "error_type": "invalid_request"}) from None
        if declared > limit:
            raise too_large(limit, what)
    chunks: list[bytes] = []
    size = 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:  # a chunked body, or one longer than it declared
            raise too_large(limit, what)
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(raw: bytes, content_encoding: str | None, limit: int,
                what: str = "--max-body-bytes") -> bytes:
    try:
        return decode_content(raw, content_encoding, limit)
    except ContentDecodingError as exc:
        if exc.too_large:
            raise too_large(limit, what) from None
        raise HTTPException(exc.status, {"message": str(exc), "error_type": "invalid_request"}) from None


def _json_error(msg: str, loc: list[str | int] | None = None, error_type: str = "json_invalid") -> NoReturn:
    raise HTTPException(422, [{"type": error_type, "loc": ["body", *(loc or [])], "msg": msg}])


def _reject_constant(name: str) -> Any:
    raise _Rejected(f"{name} is not valid JSON (send a number, null or a string)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Rejected(f"number {text[:40]} is out of range for a 64-bit float")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INTEGER_DIGITS:
        raise _Rejected(f"integer literal with {digits} digits; at most {MAX_INTEGER_DIGITS} allowed")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Rejected(f"duplicate key {key[:80]!r} in a JSON object")
            seen.add(key)
    return obj


def parse_json(raw: bytes) -> Any:
    """Python's json module, refusing NaN/Infinity, out-of-range floats, overlong integers, duplicate keys,
    lone surrogates and nesting deeper than ``MAX_JSON_DEPTH``."""
    if not raw.strip():
        _json_error("request body is empty; expected a JSON object")
    try:
        value = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float,
                           parse_int=_bounded_int, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        _json_error(f"JSON decode error: {exc.msg} (line {exc.lineno}, column {exc.colno})", [exc.pos])
    except UnicodeDecodeError:
        _json_error("request body is not valid UTF-8 text")
    except RecursionError:
        _json_error(f"JSON is nested deeper than {MAX_JSON_DEPTH} levels", error_type="json_too_deep")
    except ValueError as exc:  # _Rejected
        _json_error(str(exc))
    _check_tree(value)
    return value


# What a body may add to --max-body-bytes for its images, in 413 messages.
WITH_IMAGES = "--max-body-bytes plus --max-images images of --max-image-bytes in base64"


def check_text_size(raw: bytes, body: Any, max_body_bytes: int) -> None:
    """``max_body_bytes`` (--max-body-bytes) bounds the body without its images (``images`` entries and
    the ``data_base64`` of ``assets``; each image is bounded on its own): a 413 otherwise."""
    if len(raw) <= max_body_bytes:
        return
    images = body.get("images") if isinstance(body, dict) else None
    strings = [entry for entry in images if isinstance(entry, str)] if isinstance(images, list) else []
    assets = body.get("assets") if isinstance(body, dict) else None  # TypeSafe's, with data_base64
    if isinstance(assets, dict):
        strings += [a["data_base64"] for a in assets.values()
                    if isinstance(a, dict) and isinstance(a.get("data_base64"), str)]
    # an encoder may escape "/" as "\/": allow for it rather than count a picture's bytes as text
    text = len(raw) - sum(len(s) + s.count("/") for s in strings)
    if text > max_body_bytes:
        raise too_large(max_body_bytes, "--max-body-bytes, not counting the images" if strings
                        else "--max-body-bytes")


def validated_request(
    body: Any, limits: RequestLimits | None = None, supported: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """``body`` (parsed JSON) when it is a valid System One request within ``limits`` (the flags' bounds;
    the defaults when None) asking only ``supported`` question types, returned unchanged: the backend gets
    the body as parsed, because key order and ``1`` vs ``1.0`` reach the tokens. Else a 422: FastAPI's
    ``detail[]``, or ``unsupported_question_type``. Every HTTP decision route and ``clef-serve batch``
    decide through this function."""
    if supported is not None:
        refused = unsupported_questions(body, supported)
        if refused:
            raise unsupported_question_type(refused, supported)
    try:
        SystemOneRequest.model_validate(body, context={"limits": limits or RequestLimits()})
    except ValidationError as exc:
        raise validation_failed(exc) from None
    return body


def _check_tree(value: Any) -> None:
    """Depth and lone-surrogate check, iterative so that it cannot itself recurse too deeply.

    A lone surrogate (``"\\ud800"``) is valid JSON but cannot be encoded as UTF-8, so it would fail
    later in the tokenizer or in the response encoder as a 5xx.
    """
    stack: list[tuple[dict | list, int, tuple[str | int, ...]]] = []
    if isinstance(value, dict | list):
        stack.append((value, 1, ()))
    elif isinstance(value, str) and _SURROGATE.search(value):
        _json_error("string contains a lone UTF-16 surrogate (\\ud800-\\udfff)")
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            _json_error(f"JSON is nested deeper than {MAX_JSON_DEPTH} levels", list(path[:1]),
                        "json_too_deep")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                _json_error("object key contains a lone UTF-16 surrogate (\\ud800-\\udfff)", [*path, key])
            if isinstance(child, dict | list):
                stack.append((child, depth + 1, (*path, key)))
            elif isinstance(child, str) and _SURROGATE.search(child):
                _json_error("string contains a lone UTF-16 surrogate (\\ud800-\\udfff)", [*path, key])

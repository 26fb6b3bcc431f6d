"""TypeSafe image assets: pictures sent as ``assets`` (JSON or multipart/form-data) become ``images``.

TypeSafe's API, and its official SDK, send pictures as assets. The body's ``assets`` maps a placeholder
(the SDK's ``<image:32 hex digits>``, or any alias the caller chose) to

- ``{"type": "image", "format": "png", "data_base64": "..."}``, the picture in the JSON body, or
- ``{"type": "image", "part": "asset-0"}``, the name of a part of a ``multipart/form-data`` body whose first
  part, ``request``, is the JSON body and whose other parts are the image files (with ``part``,
  ``data_base64`` is ignored).

Each placeholder, where it appears as or inside a string of the state, of an ``instructions`` or of a
``criteria`` description, stands for its picture. Here the pictures become the request's ``images`` in the
order of their first reference (the state first, then the questions in request order, each one's
instructions before its criteria), and every reference is replaced by the positional marker
:data:`MARKER` (``[image 1]``, ``[image 2]``, ...: the picture's place among the record's pictures), so the
record reads naturally and never holds a 32-digit hex string. Object keys (a choice's labels) are never
rewritten. A score answer's ``legend`` echoes the criteria as the model read them, markers included.

Everything else is refused with a 4xx that names the item: an asset never referenced, a reference
``<image:...>`` with no asset, a part claimed twice or never claimed, a part that is missing, a part or an
asset with a content type or format that is not an image, more pictures than ``--max-images``, a picture
larger than ``--max-image-bytes``, a malformed multipart body. The multipart parser works on the body
already read into memory within the body limit (``--max-body-bytes`` plus the images' allowance), never
spools to disk, and reads at most ``--max-images`` + 1 parts with headers of at most
:data:`MAX_PART_HEADER_BYTES` each.

The decoder names a bad picture ``images[i]``; :func:`renamed` turns that back into the asset's name.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from fastapi import HTTPException

from clefserve.errors import RequestError
from clefserve.server.errors import error_detail
from clefserve.vision.decode import max_text_length

MARKER = "[image {}]"
# TypeSafe's formats (png, jpg, jpeg) and the others the decoder reads; the bytes decide the actual format
FORMATS = ("png", "jpg", "jpeg", "webp", "gif", "bmp")
# Content types an image part may carry (the SDK labels a format it does not recognise as octet-stream)
PART_CONTENT_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp",
                      "image/x-ms-bmp", "application/octet-stream")
REQUEST_PART = "request"
MAX_PART_HEADER_BYTES = 8 << 10
# The SDK's references; any other placeholder is only known when it is a key of ``assets``
REFERENCE = re.compile(r"<image:[0-9a-f]{32}>")
_PARAM = re.compile(r';\s*([A-Za-z0-9_.-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)')


@dataclass(frozen=True)
class Part:
    content_type: str | None
    data: bytes


@dataclass(frozen=True)
class Multipart:
    request: bytes  # the JSON body (the ``request`` part)
    parts: dict[str, Part]  # the other parts by name, in body order


def _refuse(status: int, message: str, error_type: str = "invalid_request") -> NoReturn:
    raise HTTPException(status, error_detail(message, error_type))


def _asset_error(loc: list[str | int], message: str, status: int = 422) -> NoReturn:
    """A 422 in FastAPI's ``detail[]`` shape (``loc`` names the asset), or a 413/415 naming it."""
    where = "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in loc[1:])
    if status != 422:
        _refuse(status, f"{loc[0]}{where}: {message}", "invalid_image")
    raise HTTPException(422, [{"type": "asset_invalid", "loc": ["body", *loc], "msg": message}])


# ---- multipart/form-data ----

def _params(header: str) -> tuple[str, dict[str, str]]:
    """A header's value and its ``; key=value`` parameters (quoted strings unescaped)."""
    value = header.split(";", 1)[0].strip().lower()
    params = {}
    for key, raw in _PARAM.findall(header[len(header.split(";", 1)[0]):]):
        if raw.startswith('"'):
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        params[key.lower()] = raw
    return value, params


def is_multipart(content_type: str) -> bool:
    return content_type.strip().lower().startswith("multipart/")


def parse_multipart(raw: bytes, content_type: str, max_parts: int) -> Multipart:
    """The ``request`` part and the image parts of a ``multipart/form-data`` body; a 4xx for anything
    else: another multipart subtype, no boundary, an unterminated body, a part without a name, two parts
    of one name, more than ``max_parts`` parts, a first part that is not ``request`` or not JSON."""
    kind, params = _params(content_type)
    if kind != "multipart/form-data":
        _refuse(415, f"{kind[:100]} bodies are not accepted: send application/json, or multipart/form-data "
                     "with the JSON in a first part named 'request' and the images in the parts its assets "
                     "name")
    boundary = params.get("boundary", "")
    if not 1 <= len(boundary) <= 200 or not boundary.isascii():
        _refuse(400, "multipart/form-data body without a boundary parameter (1 to 200 ASCII characters) in "
                     "its Content-Type")
    delimiter = b"--" + boundary.encode("ascii")
    start = raw.find(delimiter)
    if start < 0 or (start > 0 and raw[start - 2 : start] != b"\r\n"):
        _refuse(400, "multipart body: no opening boundary line")
    position = start + len(delimiter)
    parts: dict[str, Part] = {}
    request: Part | None = None
    count = 0
    while True:
        if raw[position : position + 2] == b"--":  # the closing delimiter
            break
        line_end = raw.find(b"\r\n", position)
        if line_end < 0 or raw[position:line_end].strip(b" \t"):
            _refuse(400, "multipart body: a boundary line is not followed by a line break")
        count += 1
        if count > max_parts:
            _refuse(413, f"multipart body: more than {max_parts} parts (the request and at most "
                         f"{max_parts - 1} images, --max-images)")
        headers_end = raw.find(b"\r\n\r\n", line_end, line_end + MAX_PART_HEADER_BYTES)
        if headers_end < 0:
            _refuse(400, f"multipart body: part {count} has no end of headers within "
                         f"{MAX_PART_HEADER_BYTES} bytes")
        headers = _part_headers(raw[line_end + 2 : headers_end], count)
        body_start = headers_end + 4
        next_delimiter = raw.find(b"\r\n" + delimiter, body_start)
        if next_delimiter < 0:
            _refuse(400, f"multipart body: part {count} is not closed by a boundary line (truncated body?)")
        disposition, names = _params(headers.get("content-disposition", ""))
        name = names.get("name")
        if disposition != "form-data" or not name:
            _refuse(400, f"multipart body: part {count} has no Content-Disposition: form-data; name=...")
        if name in parts or (request is not None and name == REQUEST_PART):
            _refuse(422, f"multipart body: two parts are named {name[:100]!r}")
        content_type_value = headers.get("content-type")
        part = Part(_params(content_type_value)[0] if content_type_value else None,
                    raw[body_start:next_delimiter])
        if count == 1:
            if name != REQUEST_PART:
                _refuse(422, f"multipart body: the first part must be the JSON request, named "
                             f"{REQUEST_PART!r}, not {name[:100]!r}")
            if part.content_type not in (None, "application/json"):
                _refuse(415, f"multipart part {REQUEST_PART!r}: Content-Type {part.content_type[:100]!r}; "
                             "it must be application/json")
            request = part
        else:
            parts[name] = part
        position = next_delimiter + 2 + len(delimiter)
    if request is None:
        _refuse(422, "multipart body: no parts (the JSON request goes in a first part named "
                     f"{REQUEST_PART!r})")
    return Multipart(request.data, parts)


def _part_headers(block: bytes, number: int) -> dict[str, str]:
    headers = {}
    for line in block.split(b"\r\n") if block else ():
        name, sep, value = line.partition(b":")
        if not sep:
            _refuse(400, f"multipart body: part {number} has a header line without a colon")
        headers[name.strip().decode("latin-1").lower()] = value.strip().decode("latin-1")
    return headers


# ---- assets -> images ----

@dataclass(frozen=True)
class Resolved:
    body: dict[str, Any]  # ``assets`` gone, ``images`` in order of first reference, references replaced
    names: list[str]  # how each picture is named in errors: the asset and its part


def _strings(value: Any, path: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """Every string as or inside ``value`` (list items and object values, never object keys)."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, (*path, i))


def _texts(body: dict[str, Any]) -> Iterator[tuple[str | int, ...]]:
    """Where references may stand, in reading order: the state, then each question's instructions, then
    its criteria."""
    if "state" in body:
        yield ("state",)
    questions = body.get("questions")
    if isinstance(questions, dict):
        for qid, question in questions.items():
            if isinstance(question, dict):
                for field in ("instructions", "criteria"):
                    if field in question:
                        yield ("questions", qid, field)


def _get(body: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        body = body[key]
    return body


def _rewrite(value: Any, replace: Any) -> Any:
    if isinstance(value, str):
        return replace(value)
    if isinstance(value, dict):
        return {key: _rewrite(item, replace) for key, item in value.items()}
    if isinstance(value, list):
        return [_rewrite(item, replace) for item in value]
    return value


def resolve_assets(body: Any, multipart: Multipart | None, max_images: int, max_image_bytes: int) -> Resolved:
    """The request with its assets as ``images`` (see the module's docstring); ``body`` is left as is."""
    parts = multipart.parts if multipart is not None else {}
    assets = body.get("assets") if isinstance(body, dict) else None
    if assets is None:
        if parts:
            _refuse(422, f"multipart part {next(iter(parts))[:100]!r} is not claimed by any asset (the "
                         "request has no assets)")
        if isinstance(body, dict):  # an SDK image used in text but never attached: the model would read hex
            for path in _texts(body):
                for where, text in _strings(_get(body, path), path):
                    found = REFERENCE.search(text)
                    if found is not None:
                        _asset_error(list(where), f"the reference {found[0]} has no asset: the request "
                                                  "has no assets (attach the image to the request)")
        return Resolved(body, [])
    if not isinstance(assets, dict) or not assets:
        _asset_error(["assets"], "must be a non-empty object mapping each placeholder to an image asset")
    if body.get("images"):
        _asset_error(["assets"], "send pictures either in images or as assets, not both")
    if len(assets) > max_images:
        _asset_error(["assets"], f"{len(assets)} images; at most {max_images} per request (--max-images)")
    entries: dict[str, str] = {}  # placeholder -> the picture as base64 text
    names: dict[str, str] = {}
    claimed: dict[str, str] = {}  # part name -> placeholder
    for key, asset in assets.items():
        entries[key], names[key] = _picture(key, asset, parts, claimed, multipart is not None,
                                            max_image_bytes)
    for name in parts:
        if name not in claimed:
            _refuse(422, f"multipart part {name[:100]!r} is not claimed by any asset")

    keys = sorted(assets, key=len, reverse=True)  # the longest first, where one placeholder holds another
    pattern = re.compile("|".join(re.escape(k) for k in keys) + "|" + REFERENCE.pattern)
    order: dict[str, int] = {}  # placeholder -> 1-based position, by first reference
    for path in _texts(body):
        for where, text in _strings(_get(body, path), path):
            for match in pattern.finditer(text):
                found = match[0]
                if found not in assets:
                    _asset_error(list(where), f"the reference {found} has no asset in assets")
                order.setdefault(found, len(order) + 1)
    unused = [key for key in assets if key not in order]
    if unused:
        _asset_error(["assets", unused[0]],
                     "is never referenced in the state, the instructions or the criteria")

    def replace(text: str) -> str:
        return pattern.sub(lambda m: MARKER.format(order[m[0]]), text)

    out = {key: value for key, value in body.items() if key != "assets"}  # a copy: key order kept
    if "state" in out:
        out["state"] = _rewrite(out["state"], replace)
    questions = out.get("questions")
    if isinstance(questions, dict):
        out["questions"] = {
            qid: {**q, **{f: _rewrite(q[f], replace) for f in ("instructions", "criteria") if f in q}}
            if isinstance(q, dict) else q
            for qid, q in questions.items()
        }
    ranked = sorted(order, key=order.__getitem__)
    out["images"] = [entries[key] for key in ranked]
    return Resolved(out, [names[key] for key in ranked])


def _picture(key: Any, asset: Any, parts: dict[str, Part], claimed: dict[str, str], multipart: bool,
             max_image_bytes: int) -> tuple[str, str]:
    """One asset's picture as base64 text, and its name for error messages."""
    loc: list[str | int] = ["assets", key]
    if not isinstance(key, str) or not key.strip():
        _asset_error(["assets"], "placeholders must be non-empty strings")
    if not isinstance(asset, dict):
        _asset_error(loc, 'must be an object: {"type": "image", "format": ..., "data_base64": ...} or '
                          '{"type": "image", "part": ...}')
    if asset.get("type", "image") != "image":
        _asset_error([*loc, "type"], f"only image assets are supported, not {str(asset.get('type'))[:40]!r}")
    part_name = asset.get("part")
    if part_name is not None:
        if not isinstance(part_name, str) or not part_name:
            _asset_error([*loc, "part"], "must be the name of a part of the multipart body")
        if not multipart:
            _asset_error([*loc, "part"], "names a part, but the body is not multipart/form-data (send the "
                                         "picture as data_base64, or the request as multipart/form-data)")
        if part_name == REQUEST_PART or part_name not in parts:
            _asset_error([*loc, "part"], f"the multipart body has no image part named {part_name[:100]!r}")
        if part_name in claimed:
            _asset_error([*loc, "part"], f"part {part_name[:100]!r} is already claimed by "
                                         f"assets[{claimed[part_name]!r}]; each part serves one asset")
        claimed[part_name] = key
        part = parts[part_name]
        name = f"assets[{key!r}] (multipart part {part_name!r})"
        if part.content_type is not None and part.content_type not in PART_CONTENT_TYPES:
            _refuse(415, f"{name}: Content-Type {part.content_type[:100]!r} is not an image type "
                         f"({', '.join(PART_CONTENT_TYPES)})", "invalid_image")
        if len(part.data) > max_image_bytes:
            _asset_error(loc, f"is larger than {max_image_bytes} bytes (--max-image-bytes)", 413)
        if not part.data:
            _asset_error(loc, f"multipart part {part_name!r} is empty")
        return base64.b64encode(part.data).decode("ascii"), name
    data = asset.get("data_base64")
    if not isinstance(data, str):
        _asset_error(loc, "needs data_base64 (the image file in base64, with format) or part (the name of a "
                          "part of a multipart/form-data body)")
    image_format = asset.get("format")
    if not isinstance(image_format, str) or image_format.lower() not in FORMATS:
        _asset_error([*loc, "format"], f"is required with data_base64: one of {', '.join(FORMATS)} (the "
                                       "bytes decide the actual format)")
    if len(data) > max_text_length(max_image_bytes):
        _asset_error(loc, f"is larger than {max_image_bytes} bytes (--max-image-bytes)", 413)
    return data, f"assets[{key!r}]"


def renamed(exc: RequestError, names: list[str]) -> RequestError:
    """The decoder's error about ``images[i]`` (or ``images``) told in terms of the asset it came from."""
    match = re.match(r"images(?:\[(\d+)\])?:", exc.message)
    if match is None or not names:
        return exc
    index = match[1]
    if index is not None and int(index) < len(names):
        label = names[int(index)]
    elif index is None:
        label = "assets"
    else:
        return exc
    return RequestError(label + exc.message[match.end() - 1:], exc.status, exc.error_type)


# The OpenAPI document: the multipart form beside the JSON body (which it holds as its ``request`` part),
# and the asset objects. ``assets`` stays out of SystemOneRequest's schema: a placeholder must be referenced
# in the text, a rule no JSON Schema can state.
IMAGE_ASSET_SCHEMA: dict[str, Any] = {
    "title": "ImageAsset", "type": "object",
    "description": "A value of the request's `assets` object (TypeSafe's image assets), keyed by a "
                   "placeholder (the SDK's `<image:32 hex digits>`, or any alias) that the state, an "
                   "instructions or a criteria description holds: the assets become the request's images in "
                   "the order of their first reference, and each reference is replaced by `[image N]`. "
                   "Either `data_base64` with `format`, or `part`: the name of an image part of a "
                   "multipart/form-data body.",
    "properties": {"type": {"const": "image"}, "format": {"enum": list(FORMATS)},
                   "data_base64": {"type": "string"}, "part": {"type": "string"}},
}
MULTIPART_CONTENT: dict[str, Any] = {"multipart/form-data": {
    "schema": {"type": "object", "required": [REQUEST_PART],
               "properties": {REQUEST_PART: {"$ref": "#/components/schemas/SystemOneRequest"}},
               "additionalProperties": {"type": "string", "format": "binary"},
               "description": "The JSON body as the first part, named `request`, with `assets` naming "
                              "the image parts (see ImageAsset); one part per picture, each claimed by one "
                              "asset."},
    "encoding": {REQUEST_PART: {"contentType": "application/json"}},
}}

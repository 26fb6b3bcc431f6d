"""``Content-Encoding`` of request bodies, decompressed with a bound on the output size.

The official Python SDK compresses bodies of 1 KiB or more with zstd whenever it can (Python 3.14, or the
``typesafe-sdk[zstd]`` extra), so zstd is accepted when this interpreter has a zstd module
(``compression.zstd`` on 3.14+, ``backports.zstd`` before); gzip and deflate always are.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any


class ContentDecodingError(ValueError):
    def __init__(self, message: str, status: int = 400, too_large: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.too_large = too_large


def _zstd_decompressor() -> Callable[[], Any] | None:
    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python 3.14+
    except ImportError:
        try:
            from backports import zstd  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return None
    return zstd.ZstdDecompressor


# Each factory returns a one-shot decompressor with ``decompress(data, max_length)`` and ``eof``.
DECODERS: dict[str, Callable[[], Any]] = {
    "gzip": lambda: zlib.decompressobj(16 + zlib.MAX_WBITS),
    "x-gzip": lambda: zlib.decompressobj(16 + zlib.MAX_WBITS),
    "deflate": lambda: zlib.decompressobj(zlib.MAX_WBITS),
}
_zstd = _zstd_decompressor()
if _zstd is not None:
    DECODERS["zstd"] = _zstd


def decode_content(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """Undo every coding listed in ``content_encoding`` (last applied first); output over ``limit`` bytes
    raises ``ContentDecodingError(too_large=True)``."""
    if not content_encoding:
        return raw
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        factory = DECODERS.get(coding)
        if factory is None:
            hint = " (install backports.zstd on Python < 3.14)" if coding == "zstd" else ""
            raise ContentDecodingError(
                f"Content-Encoding {coding!r} is not supported{hint}; supported: identity, "
                f"{', '.join(sorted(DECODERS))}", status=415,
            )
        raw = _decompress(factory(), raw, limit, coding)
    return raw


def _decompress(decompressor: Any, data: bytes, limit: int, coding: str) -> bytes:
    try:
        out = decompressor.decompress(data, limit + 1)
    except Exception as exc:  # zlib.error, ZstdError, ...: all mean a corrupt body
        raise ContentDecodingError(f"request body is not valid {coding} data: {exc}") from None
    if len(out) > limit or getattr(decompressor, "unconsumed_tail", b""):
        raise ContentDecodingError(f"decompressed body is larger than {limit} bytes", too_large=True)
    if not decompressor.eof:
        raise ContentDecodingError(f"request body is truncated {coding} data")
    return out

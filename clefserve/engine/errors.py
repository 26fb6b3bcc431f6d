"""Errors the engine raises at submit time (4xx for the HTTP layer) or sets on futures."""

from __future__ import annotations

from clefserve.errors import RequestError


class QueueFullError(RequestError):
    """The waiting queue is full: 429, and ``retry_after`` seconds for a ``Retry-After`` header."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, status=429, error_type="overloaded")
        self.retry_after = retry_after


def tokens_exceeded(num_tokens: int, limit: int, reason: str) -> RequestError:
    return RequestError(
        f"the record has {num_tokens} tokens; this server takes at most {limit} ({reason})",
        status=413,
        error_type="tokens_exceeded",
    )


class EngineClosedError(RuntimeError):
    """The engine was shut down before the sequence finished (or was submitted after shutdown)."""


class StepError(RuntimeError):
    """A forward step or the finish callback failed; set on the futures of the sequences it held."""

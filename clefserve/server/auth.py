"""Optional bearer-key authentication (``--api-key`` / ``CLEF_API_KEY``)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from clefserve.server.errors import error_detail

_bearer = HTTPBearer(auto_error=False, description="The key given to clef-serve with --api-key.")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _refuse(message: str) -> HTTPException:
    return HTTPException(401, error_detail(message, "authentication_error"),
                         headers={"WWW-Authenticate": "Bearer"})


def bearer_guard(api_key: str) -> Callable[..., Awaitable[None]]:
    """A dependency that admits ``Authorization: Bearer <api_key>`` and refuses anything else with 401."""
    expected = api_key.encode()

    async def require_key(credentials: Credentials) -> None:
        if credentials is None:
            raise _refuse("missing API key: send 'Authorization: Bearer <key>'")
        # Constant time, so the key cannot be guessed byte by byte from response times.
        if not hmac.compare_digest(credentials.credentials.encode(), expected):
            raise _refuse("invalid API key")

    return require_key

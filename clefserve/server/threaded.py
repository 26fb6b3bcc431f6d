"""A DecisionBackend over a synchronous decider: one request at a time, on one worker thread.

Torch work stays off the event loop, so /health and /ready answer while a decision runs. Requests wait
their turn in arrival order (``asyncio.Lock`` is FIFO); one whose client has gone away by its turn is dropped.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from clefserve.errors import RequestError

log = logging.getLogger(__name__)


class SyncDecider(Protocol):
    def decide_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]: ...


class ThreadedBackend:
    def __init__(
        self,
        decider: SyncDecider | None,
        served_model_name: str,
        *,
        description: str | None = None,
        release_date: dt.date | None = None,
        load: Callable[[], SyncDecider] | None = None,
    ) -> None:
        """``decider``: ready to use; or ``decider=None`` with ``load``, called on the worker thread by
        ``start()`` so that the server answers /health (and /ready with 503) while weights load."""
        if (decider is None) == (load is None):
            raise ValueError("pass either a decider or a load function")
        self._decider = decider
        self._load = load
        self._reason = "ready" if decider is not None else "not started"
        self._name = served_model_name
        self._description = description or f"Clef decision model {served_model_name}, served by clef-serve"
        self._release_date = release_date or dt.date.today()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-decider")
        self._turn = asyncio.Lock()
        self._loading: asyncio.Future[None] | None = None

    @classmethod
    def loading(cls, load: Callable[[], SyncDecider], served_model_name: str,
                **kwargs: Any) -> ThreadedBackend:
        return cls(None, served_model_name, load=load, **kwargs)

    def model_cards(self) -> list[dict[str, Any]]:
        return [{"name": self._name, "description": self._description,
                 "release_date": self._release_date.isoformat()}]

    def ready(self) -> tuple[bool, str]:
        return self._decider is not None, self._reason

    async def start(self) -> None:
        if self._load is not None and self._decider is None:
            self._reason = "loading the model"
            # Not awaited: the server starts serving /health and /ready while this runs.
            self._loading = asyncio.get_running_loop().run_in_executor(self._executor, self._run_load)

    def _run_load(self) -> None:
        assert self._load is not None
        try:
            decider = self._load()
        except Exception as exc:  # the log and /ready say why; the process stays up, not ready
            log.exception("loading the model failed")
            self._reason = f"loading the model failed: {type(exc).__name__}: {exc}"
            return
        self._decider = decider
        self._reason = "ready"
        log.info("model %s is ready", self._name)

    async def stop(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def decide(
        self, body: dict[str, Any], request_id: str, is_disconnected: Callable[[], Awaitable[bool]],
    ) -> dict[str, Any]:
        decider = self._decider
        if decider is None:
            raise RequestError(f"the model is not ready: {self._reason}", status=503,
                               error_type="unavailable")
        async with self._turn:
            if await is_disconnected():
                raise RequestError("the client disconnected before its turn", status=499,
                                   error_type="cancelled")
            results = await asyncio.get_running_loop().run_in_executor(
                self._executor, decider.decide_batch, [body])
        if len(results) != 1 or not isinstance(results[0], dict):
            raise RuntimeError(f"decide_batch returned {len(results)} results for 1 request")
        return results[0]

"""What the HTTP layer needs from a model: the contract between ``create_app`` and an engine."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

# What a backend answers when it does not say (an optional ``question_types()``).
DEFAULT_QUESTION_TYPES = ("noul", "choice", "score")


@runtime_checkable
class DecisionBackend(Protocol):
    def model_cards(self) -> list[dict[str, Any]]:
        """``[{"name", "description", "release_date": "YYYY-MM-DD"}]`` for ``GET /v1/models``."""
        ...

    def ready(self) -> tuple[bool, str]:
        """(ready to answer, reason shown by ``GET /ready``)."""
        ...

    async def decide(
        self, body: dict[str, Any], request_id: str, is_disconnected: Callable[[], Awaitable[bool]],
    ) -> dict[str, Any]:
        """Answer one validated System One body, exactly as the client sent it.

        Returns the response body ``{"model", "answers", "usage"}``. Raises
        ``clefserve.errors.RequestError`` for a request it must refuse (sent as that status).
        """
        ...


# Optional lifecycle: ``create_app`` awaits ``backend.start()`` when the server starts and
# ``backend.stop()`` when it stops, if the backend defines them (e.g. to load weights in the background).
# Optional observability: ``backend.stats()`` -> the engine's counters and pool gauges as a dict (or None
# before the model is loaded), read by ``GET /metrics`` at scrape time; ``backend.bind_metrics(metrics)``
# receives the app's :class:`~clefserve.server.metrics.Metrics` to observe per-decision latencies.
# Optional status (``GET /v1/status``, the console's engine panel): ``backend.status()`` ->
# ``{"phase", "ops", "self_check": {"result", "finished_at", "problem"}}`` (no paths or error texts);
# ``backend.image_support()`` -> ``{"supported", "reason", "max_images", "max_image_bytes"}`` (absent: images
# are off); an ``"audit"`` object in ``stats()`` is shown as the status's ``audit`` counters.
# Optional capability: ``backend.question_types()`` -> the question types the loaded model answers, listed by
# ``GET /v1/models``; a question of any other type is refused with 422 ``unsupported_question_type``.


def question_types(backend: Any) -> tuple[str, ...]:
    answers = getattr(backend, "question_types", None)
    return tuple(answers()) if answers is not None else DEFAULT_QUESTION_TYPES

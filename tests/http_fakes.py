"""A fake DecisionBackend for HTTP tests: well-formed answers without a model."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from clefserve.errors import RequestError


def fake_answer(question: dict[str, Any]) -> dict[str, Any]:
    kind = question["type"]
    if kind == "noul":
        return {"type": "noul", "noul": 0.75}
    criteria = question["criteria"]
    if kind == "choice":
        labels = list(criteria)
        p = 1.0 / len(labels)
        return {"type": "choice", "choice": labels[0], "confidence": round(p, 4),
                "probabilities": dict.fromkeys(labels, round(p, 4))}
    n = len(criteria)
    return {"type": "score", "score": round((n - 1) / 2, 4), "confidence": round(1 / n, 4),
            "legend": {str(i): c for i, c in enumerate(criteria)},
            "probabilities": {str(i): round(1 / n, 4) for i in range(n)}}


class FakeBackend:
    def __init__(self, name: str = "fake-clef", ready: tuple[bool, str] = (True, "ready")) -> None:
        self.name = name
        self.readiness = ready
        self.bodies: list[dict[str, Any]] = []  # what decide() received, in order
        self.request_ids: list[str] = []
        self.fail_with: BaseException | None = None

    def model_cards(self) -> list[dict[str, Any]]:
        return [{"name": self.name, "description": "a fake model for tests", "release_date": "2026-10-01"}]

    def ready(self) -> tuple[bool, str]:
        return self.readiness

    async def decide(self, body: dict[str, Any], request_id: str,
                     is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        self.bodies.append(body)
        self.request_ids.append(request_id)
        if self.fail_with is not None:
            raise self.fail_with
        if body.get("state") == "too long":
            raise RequestError("schema requires 99 tokens before state; maximum is 10", status=413,
                               error_type="tokens_exceeded")
        answers = {qid: fake_answer(q) for qid, q in body["questions"].items()}
        return {"model": body["model"], "answers": answers, "usage": {"input_tokens": 7, "output_tokens": 0}}

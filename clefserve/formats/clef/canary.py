"""The self-check: canary records through the serving path and through the plain reference path.

A fast path that returns well-formed wrong answers (a conv kernel that zeroed the key band once did) is
caught before traffic: the server runs these records batched, chunked and with the prefix cache on
through its engine, then one piece at a time with the torch reference ops, and stays unready when any
option probability differs by more than the dtype's tolerance. ``clef-serve verify`` runs the same check.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from clefserve.model.ops import reference_ops

# Tolerance on each option probability between the serving path and the reference path.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}

_TICKET = (
    "Hello, I was charged twice for order A-104 and the second charge of 59.90 EUR still shows on my card. "
    "Please refund it today; I also cannot log in to the billing portal since the last update. "
)


def canary_requests() -> list[dict[str, Any]]:
    """Records of every question type: a long state (several engine chunks), and two requests that share
    a state (the second resumes from the prefix cache)."""
    questions = {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {"type": "choice", "instructions": "Which team should handle the ticket?",
                 "criteria": {"billing": "Payments and refunds", "technical": "Bugs, outages, logins",
                              "sales": "Plans and prices", "account": None}},
        "urgency": {"type": "score", "instructions": "How urgent is it?",
                    "criteria": ["Can wait", "This week", "Today", "Right now"]},
    }
    long_state = {"channel": "email", "history": [_TICKET] * 24, "customer": {"id": 1042, "plan": "pro"}}
    short_state = {"channel": "chat", "message": _TICKET}
    return [
        {"model": "canary", "state": long_state, "questions": questions},
        {"model": "canary", "state": short_state, "questions": questions},
        {"model": "canary", "state": short_state, "questions": {"spam": {"type": "noul"},
                                                              "team": questions["team"]}},
    ]


def compare(serving: list[dict[str, Any]], reference: list[dict[str, Any]], tolerance: float) -> list[str]:
    """Mismatches between two lists of responses carrying ``x_probabilities``; empty when they agree."""
    problems = []
    for i, (ours, ref) in enumerate(zip(serving, reference, strict=True)):
        for qid, answer in ref["answers"].items():
            got = ours["answers"].get(qid, {}).get("x_probabilities", {})
            for option, p in answer["x_probabilities"].items():
                q = got.get(option)
                if q is None or not abs(q - p) <= tolerance:
                    problems.append(
                        f"canary {i} question {qid!r} option {option!r}: serving path {q}, reference {p:.6f} "
                        f"(tolerance {tolerance})"
                    )
    return problems


@contextmanager
def using_reference_ops(backbone: Any) -> Iterator[None]:
    """The torch reference ops inside the block, the serving ops put back afterwards. Only for the thread
    that runs the backbone (the engine's worker, or any thread while the engine is idle)."""
    serving_ops = backbone.ops
    backbone.set_ops(reference_ops())
    try:
        yield
    finally:
        backbone.set_ops(serving_ops)


def reference_answers(decider: Any, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One piece per record, torch reference ops; the serving ops are put back afterwards."""
    with using_reference_ops(decider.backbone):
        return decider.decide_batch(requests, raw=True)


def self_check(
    decider: Any, serve: Callable[[list[dict[str, Any]]], list[dict[str, Any]]], dtype: torch.dtype
) -> tuple[list[str], str]:
    """Run the canaries through ``serve`` (the serving path, raw probabilities on) and the reference path.

    Returns (mismatches, a report with both sets of answers for the log).
    """
    requests = canary_requests()
    served = serve(requests)
    reference = reference_answers(decider, requests)
    problems = compare(served, reference, TOLERANCE.get(dtype, 5e-2))
    report = json.dumps({"serving": served, "reference": reference}, ensure_ascii=False)
    return problems, report

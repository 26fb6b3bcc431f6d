"""From per-question logits to the ``/v1/systemone`` response body (clef-format.md §6)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from clefserve.confidence import confidence as answer_confidence
from clefserve.formats.clef.records import EncodedRecord

DIGITS = 4


def probabilities(logits: Sequence[torch.Tensor]) -> list[list[float]]:
    """Float32 softmax of each question's logits, over that question's options only.

    One copy to the CPU, then one softmax per question: the same float32 ops as the reference, so equal
    logits give bit-equal probabilities (a padded softmax could differ in the last bit).
    """
    flat = torch.cat([q.reshape(-1) for q in logits]).float().cpu()
    return [q.softmax(-1).tolist() for q in flat.split([q.numel() for q in logits])]


def answer_question(
    question: dict[str, Any], option_ids: Sequence[str], probs: Sequence[float], confidence: str = "clef",
) -> dict[str, Any]:
    """One answer from the probabilities of the question's options (``option_ids`` in the head's order).

    ``confidence``: ``clef`` (the top probability, as the reference) or ``typesafe`` (TypeSafe's formulas,
    :mod:`clefserve.confidence`), computed from the unrounded probabilities."""
    p = dict(zip(option_ids, probs, strict=True))
    if not all(math.isfinite(v) for v in probs):
        raise FloatingPointError(f"non-finite probabilities {list(probs)} for options {list(option_ids)}")
    kind = question["type"]
    if kind == "noul":
        return {"type": "noul", "noul": round(p["true"], DIGITS)}
    if kind == "choice":
        labels = [str(label) for label in question["criteria"]]
        choice = labels[0]
        for label in labels[1:]:  # strictly greater: ties go to the earlier label in request order
            if p[label] > p[choice]:
                choice = label
        label_probs = [p[label] for label in labels]
        return {
            "type": "choice",
            "choice": choice,
            "confidence": round(answer_confidence("choice", label_probs, confidence), DIGITS),
            "probabilities": {label: round(p[label], DIGITS) for label in labels},
        }
    levels = [str(i) for i in range(len(question["criteria"]))]
    level_probs = [p[level] for level in levels]
    expected = sum(i * q for i, q in enumerate(level_probs))
    return {
        "type": "score",
        "score": round(expected, DIGITS),
        "confidence": round(answer_confidence("score", level_probs, confidence), DIGITS),
        "legend": dict(zip(levels, question["criteria"], strict=True)),
        "probabilities": {level: round(p[level], DIGITS) for level in levels},
    }


def build_response(
    request: dict[str, Any],
    record: EncodedRecord,
    logits: Sequence[torch.Tensor],
    raw: bool = False,
    cached_tokens: int | None = None,
    confidence: str = "clef",
) -> dict[str, Any]:
    """The response body for ``request``, whose encoding is ``record`` and head output ``logits``.

    ``raw`` adds ``x_probabilities`` (unrounded float32 probabilities by option id) to every answer, an
    extension field for audits and exact comparisons (``--x-raw-probabilities``). ``cached_tokens`` (the
    record's leading tokens served from the prefix cache) adds ``usage.x_cached_tokens``. ``confidence``
    chooses the confidence definition (``--confidence``).
    """
    questions = request["questions"]
    probs = probabilities(logits)
    answers = {}
    for q, q_probs in zip(record.questions, probs, strict=True):
        answer = answer_question(questions[q.question_id], q.option_ids, q_probs, confidence)
        if raw:
            answer["x_probabilities"] = dict(zip(q.option_ids, q_probs, strict=True))
        answers[q.question_id] = answer
    usage: dict[str, int] = {"input_tokens": len(record.input_ids), "output_tokens": 0}
    if cached_tokens is not None:
        usage["x_cached_tokens"] = cached_tokens
    return {"model": request["model"], "answers": answers, "usage": usage}

"""Comparing our ``/v1/systemone`` responses with the reference's, allowing only rounding-boundary flips.

A rounded value may differ from the reference's only when the reference's unrounded value lies within
``margin`` of a rounding boundary ((k + 0.5)·10⁻⁴), where a difference in the last float bits of the
probabilities can flip ``round(x, 4)``. Everything else (keys, key order, choices, legends, token counts)
must be identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

DIGITS = 4


@dataclass
class Raw:
    """The unrounded reference value behind one rounded field, and how far ours may be from it."""

    value: float
    tolerance: float


@dataclass
class Report:
    compared: int = 0
    boundary_flips: list[tuple[tuple, float, float]] = field(default_factory=list)


def near_rounding_boundary(value: float, margin: float, digits: int = DIGITS) -> bool:
    scaled = value * 10**digits
    return abs(scaled - math.floor(scaled) - 0.5) * 10**-digits <= margin


def unrounded_answer(question: dict[str, Any], probs: dict[str, float], tolerance: float) -> dict[str, Any]:
    """The reference answer's rounded fields before rounding (``systemone_answer``'s arithmetic)."""
    if question["type"] == "noul":
        return {"noul": Raw(probs["true"], tolerance)}
    if question["type"] == "choice":
        labels = [str(label) for label in question["criteria"]]
        return {
            "confidence": Raw(max(probs[label] for label in labels), tolerance),
            "probabilities": {label: Raw(probs[label], tolerance) for label in labels},
        }
    levels = [str(i) for i in range(len(question["criteria"]))]
    return {
        "score": Raw(
            sum(i * probs[level] for i, level in enumerate(levels)), tolerance * max(1, len(levels) - 1)
        ),
        "confidence": Raw(max(probs[level] for level in levels), tolerance),
        "probabilities": {level: Raw(probs[level], tolerance) for level in levels},
    }


def assert_same_response(
    ours: dict[str, Any],
    ref: dict[str, Any],
    request: dict[str, Any],
    ref_probs: dict[str, dict[str, float]],
    tolerance: float = 2e-4,
    margin: float = 1e-5,
) -> Report:
    """``ref_probs``: question id -> option id -> the reference's unrounded probability."""
    raw = {
        "answers": {
            qid: unrounded_answer(question, ref_probs[qid], tolerance)
            for qid, question in request["questions"].items()
        }
    }
    report = Report()
    _walk(ours, ref, raw, (), margin, report)
    return report


def _walk(ours: Any, ref: Any, raw: Any, path: tuple, margin: float, report: Report) -> None:
    if isinstance(raw, Raw):
        assert isinstance(ours, float) and isinstance(ref, float), (path, ours, ref)
        assert abs(ours - ref) <= raw.tolerance, (path, ours, ref)
        report.compared += 1
        if ours != ref:
            assert near_rounding_boundary(raw.value, margin), (path, ours, ref, raw.value)
            report.boundary_flips.append((path, ours, ref))
        return
    if isinstance(ref, dict):
        assert isinstance(ours, dict) and list(ours) == list(ref), (path, ours, ref)
        for key, value in ref.items():
            inner = raw.get(key) if isinstance(raw, dict) else None
            _walk(ours[key], value, inner, (*path, key), margin, report)
        return
    if isinstance(ref, list):
        assert isinstance(ours, list) and len(ours) == len(ref), (path, ours, ref)
        for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
            _walk(a, b, None, (*path, i), margin, report)
        return
    assert type(ours) is type(ref) and ours == ref, (path, ours, ref)

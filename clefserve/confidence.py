"""The ``confidence`` of choice and score answers: Clef's top probability, or TypeSafe's formulas.

``clef`` (the default, ``--confidence clef``) is what Cloudflare's reference returns: the probability of the
chosen label, or of the most probable score level. ``typesafe`` is the definition TypeSafe documents and its
official adapter implements (systemone-api.md §3.1), computed from the unrounded probabilities after
renormalising them to sum 1 (an all-zero vector counts as uniform):

- choice, n labels, top probability m: ``(m - 1/n) / (1 - 1/n)``; 1 when n = 1. 0 for a uniform answer,
  1 when all mass is on one label.
- score, n levels, mode k (the lowest level among equally probable ones):
  ``max(0, 1 - sum_i p_i |i - k| / D)`` with ``D = (1/n) sum_i |i - (n-1)/2|``, the mean absolute deviation
  of a uniform distribution over the levels; 1 when n = 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

CONFIDENCE_MODES = ("clef", "typesafe")


def _normalised(probabilities: Sequence[float]) -> list[float]:
    total = math.fsum(probabilities)
    if not total > 0 or not math.isfinite(total):
        return [1.0 / len(probabilities)] * len(probabilities)
    return [p / total for p in probabilities]


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value))


def typesafe_choice_confidence(probabilities: Sequence[float]) -> float:
    n = len(probabilities)
    if n == 1:
        return 1.0
    top = max(_normalised(probabilities))
    return _unit((top - 1.0 / n) / (1.0 - 1.0 / n))


def typesafe_score_confidence(probabilities: Sequence[float]) -> float:
    n = len(probabilities)
    if n == 1:
        return 1.0
    p = _normalised(probabilities)
    mode = p.index(max(p))
    spread = math.fsum(pi * abs(i - mode) for i, pi in enumerate(p))
    centre = (n - 1) / 2
    uniform_spread = math.fsum(abs(i - centre) for i in range(n)) / n
    return _unit(1.0 - spread / uniform_spread)


def confidence(kind: str, probabilities: Sequence[float], mode: str = "clef") -> float:
    """Unrounded confidence of a ``choice`` or ``score`` answer whose options have ``probabilities``
    (choice: any order; score: level 0 first)."""
    if mode == "clef":
        return max(probabilities)
    if mode != "typesafe":
        raise ValueError(f"confidence mode must be one of {CONFIDENCE_MODES}, not {mode!r}")
    if kind == "choice":
        return typesafe_choice_confidence(probabilities)
    if kind == "score":
        return typesafe_score_confidence(probabilities)
    raise ValueError(f"no confidence for {kind!r} answers")

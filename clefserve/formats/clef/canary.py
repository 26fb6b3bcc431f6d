"""The self-check: canary records through the serving path and through the plain reference path.

A fast path that returns well-formed wrong answers (a conv kernel that zeroed the key band once did) is
caught before traffic: the server runs these records batched, chunked and with the prefix cache on
through its engine, then one piece at a time with the torch reference ops, and stays unready when any
option probability differs by more than the dtype's tolerance. ``clef-serve verify`` runs the same check.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from clefserve.model.ops import reference_ops

# Tolerance on each option probability between the serving path and the reference path.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}

_TICKET = (
    "Hello, I was charged twice for order A-104 and the second charge of 59.90 EUR still shows on my card. "
    "Please refund it today; I also cannot log in to the billing portal since the last update. "
)


def canary_picture(width: int, height: int, fmt: str, seed: int) -> str:
    """A deterministic picture (gradients, a disc, a checkerboard) as a data URL."""
    y, x = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(seed)
    cx, cy = rng.uniform(0.2, 0.8) * width, rng.uniform(0.2, 0.8) * height
    disc = ((x - cx) ** 2 + (y - cy) ** 2) < (0.25 * min(width, height)) ** 2
    checker = ((x // 8 + y // 8) % 2).astype(np.float64)
    rgb = np.stack([255 * x / width, 255 * disc, 64 + 128 * checker * (y / height)], axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8), "RGB").save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def image_canary_requests() -> list[dict[str, Any]]:
    """Pictures through the vision tower, the placeholders and M-RoPE positions: the same state and
    questions with two pictures, then with another first picture of the same size (the same token ids:
    a prefix cache keyed on ids alone would answer it from the first record), then the first pictures
    with other questions (the encoder cache and the prefix cache through the pictures)."""
    photo, other_photo = canary_picture(256, 192, "PNG", 1), canary_picture(256, 192, "PNG", 3)
    chart = canary_picture(96, 160, "JPEG", 2)
    questions = {
        "damaged": {"type": "noul", "instructions": "Does the photo show a damaged parcel?"},
        "kind": {"type": "choice", "instructions": "What does the first picture show?",
                 "criteria": {"parcel": "A parcel", "receipt": "A receipt", "screenshot": None}},
    }
    state = {"channel": "email", "message": _TICKET, "attachments": 2}
    return [
        {"model": "canary", "state": state, "questions": questions, "images": [photo, chart]},
        {"model": "canary", "state": state, "questions": questions, "images": [other_photo, chart]},
        {"model": "canary", "state": state, "images": [photo, chart],
         "questions": {"urgency": {"type": "score", "instructions": "How urgent is it?",
                                   "criteria": ["Can wait", "Today", "Right now"]}}},
    ]


def canary_requests(images: bool = False) -> list[dict[str, Any]]:
    """Records of every question type: a long state (several engine chunks), and two requests that share
    a state (the second resumes from the prefix cache); with ``images``, records with pictures too."""
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
    text = [
        {"model": "canary", "state": long_state, "questions": questions},
        {"model": "canary", "state": short_state, "questions": questions},
        {"model": "canary", "state": short_state, "questions": {"spam": {"type": "noul"},
                                                              "team": questions["team"]}},
    ]
    return text + image_canary_requests() if images else text


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


def reference_answers(decider: Any, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One piece per record, torch reference ops, pictures encoded afresh (not from the encoder cache);
    the serving ops are put back afterwards."""
    backbone = decider.backbone
    serving_ops = backbone.ops
    backbone.set_ops(reference_ops())
    try:
        return decider.decide_batch(requests, raw=True, fresh_images=True)
    finally:
        backbone.set_ops(serving_ops)


def self_check(
    decider: Any, serve: Callable[[list[dict[str, Any]]], list[dict[str, Any]]], dtype: torch.dtype
) -> tuple[list[str], str]:
    """Run the canaries through ``serve`` (the serving path, raw probabilities on) and the reference path.

    Returns (mismatches, a report with both sets of answers for the log).
    """
    requests = canary_requests(images=bool(getattr(decider, "takes_images", False)))
    served = serve(requests)
    reference = reference_answers(decider, requests)
    problems = compare(served, reference, TOLERANCE.get(dtype, 5e-2))
    report = json.dumps({"serving": served, "reference": reference}, ensure_ascii=False)
    return problems, report

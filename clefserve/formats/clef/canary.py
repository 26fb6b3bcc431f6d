"""The self-check: canary records through the serving path and through the plain reference path.

A fast path that returns well-formed wrong answers (a conv kernel that zeroed the key band once did) is
caught before traffic: the server runs these records batched, chunked and with the prefix cache on
through its engine, then one piece at a time with the torch reference ops, and stays unready when any
option probability differs by more than the dtype's tolerance. ``clef-serve verify`` runs the same check.

Three text canaries, sized in tokens from the engine's configuration, no larger than their coverage needs
(every token runs twice, and on a 9B model on a CPU a token costs tens of milliseconds):

1. ``long``: a state of one ``--prefill-chunk-size`` plus :data:`LONG_MARGIN_TOKENS`, so the engine cuts
   the state at its step budget and passes the cache's snapshot points (their GDN state kept inside a
   step or taken at a step's end): state carried across chunk boundaries inside a segment;
2. ``shared-a``: a short state, a choice and a score question (scored jointly);
3. ``shared-b``: the same state and a noul question, resumed from the prefix cache at the end of that
   shared state (the K/V blocks, the GDN snapshot and the cached hidden rows of ``shared-a``).

Between them every question type (noul, choice, score) and every kind of option description (text, null,
a noul default, a noul override).

With a vision tower (``images=True``), three more carry two pictures each:

4. ``image-a``: a photo and a chart with a state and questions;
5. ``image-b``: another photo of the same size (the same token ids: a prefix cache keyed on ids alone would
   answer it from ``image-a``) with the same state and questions;
6. ``image-c``: ``image-a``'s pictures with other questions (the encoder cache and the prefix cache through
   the pictures).

All of them run through the engine together (steps with several sequences), then one by one through the
reference path.

What the engine actually did (the long canary's chunks, the tokens ``shared-b`` took from the cache) is read
back from the engine's step trace and logged, so a configuration that cannot exercise a path says so.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from clefserve.formats.clef.records import MIN_STATE_SNAPSHOT_TOKENS, EncodedRecord
from clefserve.model.ops import reference_ops

log = logging.getLogger(__name__)

# Tolerance on each option probability between the serving path and the reference path.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}
# The long canary's state exceeds one engine chunk by this many tokens: a 64-token chunk of the delta rule
# and several KV blocks run after the budget split.
LONG_MARGIN_TOKENS = 64

_TICKET_LINES = (
    "Hello, I was charged twice for order A-104 and the second charge of 59.90 EUR still shows on my card.",
    "Please refund it today; I also cannot log in to the billing portal since the last update.",
    "Agent: we see two captures for A-104 and opened a refund request with the payments team.",
    "Customer: thanks, but the portal still says my password expired and the reset mail never arrives.",
)
_SHORT_STATE = {"message": "Charged twice for A-104."}
# Short texts: schemas run twice like states do, and the record format spends tens of tokens per option
# anyway. Between them every question type, and descriptions of every kind (text, null, a noul default and
# a noul override).
_LONG_QUESTIONS = {"refund": {"type": "choice", "instructions": "Refund asked?",
                              "criteria": {"yes": None, "no": None}}}
_SHARED_A_QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team?",
             "criteria": {"technical": "Bugs", "billing": None}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["Later", "Today", "Now"]},
}
_SHARED_B_QUESTIONS = {"spam": {"type": "noul", "criteria": {"true": "Advertising"}}}


@dataclass(frozen=True)
class Canary:
    name: str
    request: dict[str, Any]
    record: EncodedRecord

    @property
    def tokens(self) -> int:
        return len(self.record.input_ids)

    @property
    def state_tokens(self) -> int:
        return self.record.state_end - self.record.prefix_end


def _long_request(chars: int) -> dict[str, Any]:
    """The long canary with ``chars`` characters of ticket history (the last line cut short)."""
    history = []
    while chars > 0:
        line = f"{len(history) + 1}. {_TICKET_LINES[len(history) % len(_TICKET_LINES)]}"[:chars]
        history.append(line)
        chars -= len(line)
    state = {"channel": "email", "customer": {"id": 1042, "plan": "pro"}, "history": history}
    return {"model": "canary", "state": state, "questions": _LONG_QUESTIONS}


def long_canary(encode: Callable[[dict[str, Any]], EncodedRecord], chunk_tokens: int,
                max_tokens: int) -> tuple[Canary, bool]:
    """The long canary for an engine stepping ``chunk_tokens`` at a time whose records hold at most
    ``max_tokens`` (``--max-length``, or the KV pool when smaller); and whether its state spans two chunks.

    Its state is the shortest history whose tokens reach ``chunk_tokens + LONG_MARGIN_TOKENS``. When no
    record can hold a state longer than one chunk, no request is ever split inside its state, and a
    short long canary (a few hundred tokens) stands in."""
    def state_tokens(chars: int) -> int:
        record = encode(_long_request(chars))
        return record.state_end - record.prefix_end

    empty = encode(_long_request(0))
    room = max_tokens - (len(empty.input_ids) - (empty.state_end - empty.prefix_end))
    splits = room > chunk_tokens
    target = max(0, min(chunk_tokens + LONG_MARGIN_TOKENS if splits else 4 * LONG_MARGIN_TOKENS, room))
    high = 64
    while state_tokens(high) < target:
        high *= 2
    low = 0  # state_tokens(low) < target <= state_tokens(high), unless target is 0
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if state_tokens(middle) >= target else (middle, high)
    chars = high if target > 0 else 0
    record = encode(_long_request(chars))
    while len(record.input_ids) > max_tokens and chars > 0:  # a small KV pool: the state is not cut to fit
        chars -= 1
        record = encode(_long_request(chars))
    return Canary("long", _long_request(chars), record), splits


def shared_state(encode: Callable[[dict[str, Any]], EncodedRecord]) -> dict[str, Any]:
    """The shared canaries' state: short, but long enough in this tokenizer for the serving path to keep a
    resume point at its end (``MIN_STATE_SNAPSHOT_TOKENS``), so that ``shared-b`` resumes from it."""
    state = dict(_SHORT_STATE)
    for _ in range(64):
        record = encode({"model": "canary", "state": state, "questions": _SHARED_B_QUESTIONS})
        if record.state_end - record.prefix_end >= MIN_STATE_SNAPSHOT_TOKENS:
            break
        state["message"] += " The second charge appeared on the next statement as well."
    return state


def build_canaries(encode: Callable[[dict[str, Any]], EncodedRecord], chunk_tokens: int,
                   max_tokens: int, images: bool = False) -> tuple[list[Canary], bool]:
    """The canaries in the order they are submitted (the long one first, so the engine gives it whole
    chunks; with ``images``, the ones with pictures last); and whether the long one's state spans two
    chunks."""
    long, splits = long_canary(encode, chunk_tokens, max_tokens)
    state = shared_state(encode)
    shared = [
        {"model": "canary", "state": state, "questions": _SHARED_A_QUESTIONS},
        {"model": "canary", "state": state, "questions": _SHARED_B_QUESTIONS},
    ]
    named = [*zip(("shared-a", "shared-b"), shared, strict=True),
             *(image_canary_requests() if images else ())]
    return [long, *(Canary(name, r, encode(r)) for name, r in named)], splits


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


def image_canary_requests() -> list[tuple[str, dict[str, Any]]]:
    """The named canaries with pictures (see the module's docstring)."""
    photo, other_photo = canary_picture(256, 192, "PNG", 1), canary_picture(256, 192, "PNG", 3)
    chart = canary_picture(96, 160, "JPEG", 2)
    questions = {
        "damaged": {"type": "noul", "instructions": "Does the photo show a damaged parcel?"},
        "kind": {"type": "choice", "instructions": "What does the first picture show?",
                 "criteria": {"parcel": "A parcel", "receipt": "A receipt", "screenshot": None}},
    }
    state = {"channel": "email", "message": " ".join(_TICKET_LINES[:2]), "attachments": 2}
    return [
        ("image-a", {"model": "canary", "state": state, "questions": questions, "images": [photo, chart]}),
        ("image-b", {"model": "canary", "state": state, "questions": questions,
                     "images": [other_photo, chart]}),
        ("image-c", {"model": "canary", "state": state, "images": [photo, chart],
                     "questions": {"urgency": {"type": "score", "instructions": "How urgent is it?",
                                               "criteria": ["Can wait", "Today", "Right now"]}}}),
    ]


def label(i: int, canaries: Sequence[Canary]) -> str:
    return f"canary {i + 1} of {len(canaries)} ({canaries[i].name})"


def compare(canaries: Sequence[Canary], serving: list[dict[str, Any]], reference: list[dict[str, Any]],
            tolerance: float) -> list[str]:
    """Mismatches between two lists of responses carrying ``x_probabilities``; empty when they agree."""
    problems = []
    for i, (ours, ref) in enumerate(zip(serving, reference, strict=True)):
        for qid, answer in ref["answers"].items():
            got = ours["answers"].get(qid, {}).get("x_probabilities", {})
            for option, p in answer["x_probabilities"].items():
                q = got.get(option)
                if q is None or not abs(q - p) <= tolerance:
                    problems.append(
                        f"{label(i, canaries)} question {qid!r} option {option!r}: serving path {q}, "
                        f"reference {p:.6f} (tolerance {tolerance})"
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


def reference_answers(decider: Any, canaries: Sequence[Canary]) -> list[dict[str, Any]]:
    """One record at a time in one piece, torch reference ops, pictures encoded afresh (not from the encoder
    cache), progress logged; the serving ops are put back afterwards."""
    answers = []
    with using_reference_ops(decider.backbone):
        for i, canary in enumerate(canaries):
            started = time.perf_counter()
            answers += decider.decide_batch([canary.request], raw=True, fresh_images=True)
            log.info("self-check %s, reference path: %d tokens in %.1f s", label(i, canaries), canary.tokens,
                     time.perf_counter() - started)
    return answers


@dataclass
class Coverage:
    """What the serving path exercised, read back from the engine's steps."""

    long_chunks: list[int]  # tokens the long canary ran in each step
    budget_split: bool  # a piece of the long canary ended inside its state because its step's budget ran out
    shared_state_cached: bool  # shared-b resumed at (or past) the end of its state from the cache
    batched_steps: int  # steps that ran several canaries together

    def summary(self) -> str:
        chunks = ", ".join(str(n) for n in self.long_chunks)
        return (f"long canary in {len(self.long_chunks)} chunks [{chunks}] "
                f"({'split' if self.budget_split else 'NOT split'} inside its state by the chunk budget), "
                f"shared state {'resumed' if self.shared_state_cached else 'NOT resumed'} from the prefix "
                f"cache, {self.batched_steps} steps with several canaries")


def coverage(canaries: Sequence[Canary], served: Sequence[dict[str, Any]],
             steps: Sequence[Sequence[tuple[int, int]]]) -> Coverage:
    """``steps``: the engine's ``((seq_id, tokens), ...)`` of each step the canaries ran in."""
    long, shared_b = canaries[0], canaries[2]
    computed = long.tokens - served[0]["usage"].get("x_cached_tokens", 0)
    runs: dict[int, list[int]] = {}  # per sequence: its tokens in each step
    for step in steps:
        for seq_id, n in step:
            runs.setdefault(seq_id, []).append(n)
    long_chunks = next((run for run in runs.values() if sum(run) == computed), [])
    # no snapshot point lies inside the state, so a piece that ends there was cut by the step's budget
    # (whether or not the step used all of it: the scheduler ends cuts on delta-rule chunk boundaries)
    position, split = long.tokens - computed, False
    for n in long_chunks:
        position += n
        split |= long.record.prefix_end < position < long.record.state_end
    cached = served[2]["usage"].get("x_cached_tokens", 0) >= shared_b.record.state_end
    return Coverage(long_chunks, split, cached, sum(1 for step in steps if len(step) > 1))


def self_check(
    decider: Any, serve: Callable[[Sequence[Canary]], list[dict[str, Any]]], canaries: Sequence[Canary],
    dtype: torch.dtype,
) -> tuple[list[str], str]:
    """Run ``canaries`` through ``serve`` (the serving path, raw probabilities on) and the reference path.

    Returns (mismatches, a report with both sets of answers for the log).
    """
    served = serve(canaries)
    reference = reference_answers(decider, canaries)
    problems = compare(canaries, served, reference, TOLERANCE.get(dtype, 5e-2))
    report = json.dumps({"serving": served, "reference": reference}, ensure_ascii=False)
    return problems, report

"""Live audit: a random sample of answered requests re-run through the torch reference path in idle time.

The startup self-check proves the serving path on a few canary records; a fault that shows only on long
records, at a chunk boundary or with a warm prefix cache passes it. So a share (``--audit-fraction``) of
the requests the server answered is run again, one-piece-per-record style, with the plain torch reference
ops and a dense per-record cache (no paging, no batching, no prefix cache), and every unrounded option
probability is compared with what the serving path computed, at the self-check's tolerance.

Where it runs: on the engine's worker thread, only while no sequence waits or runs, one piece of at most
``--prefill-chunk-size`` tokens per engine loop turn (:meth:`Engine.set_idle_work`). A request that arrives
meanwhile waits for that piece only, about one engine step. A separate low-priority thread was the other
choice; it was rejected because torch's intra-op threads and the device are shared (a "background" thread
would slow every live step, not only wait for idle time), and because the reference ops are swapped onto
the shared backbone for the piece, which is only safe on the thread that runs the backbone.

Requests with pictures are audited with their pictures: the sampled request keeps its preprocessed pixels
(the coin is tossed when it is submitted, so only sampled requests hold them past admission), and the audit
runs the vision tower afresh on them (never from the encoder cache), one picture per idle turn, before the
backbone pieces; the pixels count in ``--audit-queue-mb``. A sampled record whose pixels are missing is
skipped (``skipped_because["no_pixels"]``).

The cost is the reference compute of the audited records (about the same as serving them unbatched, so
``--audit-fraction 0.01`` costs about 1% of the engine's time), and while a record is audited, its dense
K/V and hidden rows (one record at a time). Under sustained full load there is no idle time: the queue
fills and the oldest samples are dropped, counted as skipped.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from clefserve.formats.clef.answers import probabilities
from clefserve.formats.clef.canary import TOLERANCE, using_reference_ops
from clefserve.formats.clef.records import EncodedRecord
from clefserve.model.inputs import SequenceInputs

if TYPE_CHECKING:
    from clefserve.formats.clef.decider import ClefDecider
    from clefserve.model.cache import SequenceState

log = logging.getLogger(__name__)

RESULTS = ("match", "mismatch", "skipped")
# Upper bounds of the largest |serving - reference| per audited request (probabilities, so at most 1).
DIFFERENCE_BUCKETS = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0)
# Options listed in one mismatch log line (a record can have thousands); the count says how many more.
LOGGED_OPTIONS = 16


@dataclass
class AuditJob:
    request_id: str
    ids: torch.Tensor  # int32 on the CPU: 4 bytes a token instead of a tuple of Python ints
    record: EncodedRecord  # its spans and option ids, input_ids emptied (they are in ``ids``)
    served: list[list[float]]  # the serving path's unrounded probabilities, per question in record order
    nbytes: int
    done: int = 0  # tokens run through the reference backbone so far
    state: SequenceState | None = None
    hidden: list[torch.Tensor] = field(default_factory=list)
    pictures: list[torch.Tensor] = field(default_factory=list)  # vision-tower rows, one picture a turn
    inputs: SequenceInputs | None = None  # the pictures' rows and M-RoPE positions, once all are encoded

    @classmethod
    def of(cls, request_id: str, record: EncodedRecord, served: list[list[float]]) -> AuditJob:
        ids = torch.tensor(record.input_ids, dtype=torch.int32)
        options = sum(len(p) for p in served)
        # what the queue holds for it: the ids, the probabilities and option ids, the pictures' pixels,
        # object overheads
        pixels = sum(image.patches.pixels.nbytes for image in record.prepared_images)
        nbytes = 4 * ids.numel() + 128 * options + 256 * len(served) + pixels + 512
        return cls(request_id, ids, replace(record, input_ids=()), served, nbytes)


class DifferenceHistogram:
    """Prometheus-style buckets of the largest difference per audited request."""

    def __init__(self, bounds: tuple[float, ...] = DIFFERENCE_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def snapshot(self) -> dict[str, Any]:
        """``{"buckets": [[upper bound, cumulative count], ...], "sum", "count"}``; the last bound is the
        string ``"+Inf"``, so that the stats stay plain JSON."""
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, "+Inf"], self.counts, strict=True):
            cumulative += count
            buckets.append([bound, cumulative])
        return {"buckets": buckets, "sum": self.total, "count": cumulative}


class Auditor:
    """Samples answered requests (:meth:`offer`, engine thread), re-runs them piece by piece in idle time
    (:meth:`run_piece`, engine thread) and keeps the counts (:meth:`stats`, any thread)."""

    def __init__(
        self,
        decider: ClefDecider,
        fraction: float,
        piece_tokens: int,
        max_queue: int = 64,
        max_queue_bytes: int = 64 << 20,
        fail_after: int = 0,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"--audit-fraction must lie in (0, 1] to audit (0 turns it off), got {fraction}")
        if piece_tokens < 1 or max_queue < 1 or max_queue_bytes < 1 or fail_after < 0:
            raise ValueError("audit piece, queue bounds must be positive and --audit-fail-ready >= 0")
        self.decider = decider
        self.fraction = fraction
        self.piece_tokens = piece_tokens
        self.max_queue, self.max_queue_bytes = max_queue, max_queue_bytes
        self.fail_after = fail_after
        self.tolerance = TOLERANCE.get(decider.backbone.dtype, 5e-2)
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._queue: deque[AuditJob] = deque()
        self._queue_bytes = 0
        self._current: AuditJob | None = None
        self._counts = dict.fromkeys(RESULTS, 0)
        self._skipped_because: dict[str, int] = {}
        self._histogram = DifferenceHistogram()
        self._last_mismatch: dict[str, Any] | None = None
        self._seconds = 0.0  # reference compute spent, for the README's cost claim and the console

    # ---- sampling (engine thread, in the finish callback) ----

    def sample(self) -> bool:
        return self.fraction >= 1 or self._rng.random() < self.fraction

    def offer(self, request_id: str, record: EncodedRecord, served: list[list[float]]) -> None:
        """Queue an answered request for the audit; when the queue is full (count or bytes), the oldest
        samples make room and count as skipped (the newest traffic is the most telling)."""
        job = AuditJob.of(request_id, record, served)
        with self._lock:
            if record.images and len(record.prepared_images) != len(record.images):
                self._skip("no_pixels")
                return
            if job.nbytes > self.max_queue_bytes:
                self._skip("too_large")
                return
            while self._queue and (len(self._queue) >= self.max_queue
                                   or self._queue_bytes + job.nbytes > self.max_queue_bytes):
                dropped = self._queue.popleft()
                self._queue_bytes -= dropped.nbytes
                self._skip("queue_full")
            self._queue.append(job)
            self._queue_bytes += job.nbytes

    def _skip(self, reason: str) -> None:
        self._counts["skipped"] += 1
        self._skipped_because[reason] = self._skipped_because.get(reason, 0) + 1

    # ---- idle work (engine thread) ----

    def pending(self) -> bool:
        return self._current is not None or bool(self._queue)

    def run_piece(self) -> None:
        """Run the next piece of the current audit (the head and the comparison after its last piece)."""
        job = self._current
        if job is None:
            with self._lock:
                if not self._queue:
                    return
                job = self._current = self._queue.popleft()
                self._queue_bytes -= job.nbytes
        started = time.perf_counter()
        try:
            self._advance(job)
        except Exception:
            log.exception("live audit of request %s failed; counted as skipped", job.request_id,
                          extra={"request_id": job.request_id})
            with self._lock:
                self._current = None
                self._skip("error")
        finally:
            self._seconds += time.perf_counter() - started

    def _advance(self, job: AuditJob) -> None:
        if job.record.images and job.inputs is None:
            self._encode_picture(job)
            return
        backbone = self.decider.backbone
        total = job.ids.numel()
        piece = job.ids[job.done : job.done + self.piece_tokens].long()
        with using_reference_ops(backbone):
            hidden, job.state = backbone.run_sequence(piece, job.state, job.inputs)
        job.hidden.append(hidden)
        job.done += piece.numel()
        if job.done < total:
            return
        record = replace(job.record, input_ids=tuple(job.ids.tolist()))
        rows = torch.cat(job.hidden)
        job.hidden, job.state, job.inputs = [], None, None
        reference = probabilities(self.decider.logits([rows], [record])[0])
        self._conclude(job, reference)

    def _encode_picture(self, job: AuditJob) -> None:
        """The next picture through the vision tower, afresh; after the last one, the record's inputs."""
        images = self.decider.images
        assert images is not None, "a record with pictures on a release without a vision tower"
        record = job.record
        job.pictures.append(images.embed([record.prepared_images[len(job.pictures)]], use_cache=False)[0])
        if len(job.pictures) < len(record.images):
            return
        ids_length = replace(record, input_ids=(0,) * job.ids.numel())  # positions need the length only
        job.inputs = SequenceInputs(
            embeds=tuple((image.span.start, rows) for image, rows in zip(record.images, job.pictures,
                                                                          strict=True)),
            positions=ids_length.positions())
        job.pictures = []
        job.record = replace(record, prepared_images=())  # the pixels are in the rows now

    def _conclude(self, job: AuditJob, reference: list[list[float]]) -> None:
        largest, wrong = 0.0, []
        for question, served, ref in zip(job.record.questions, job.served, reference, strict=True):
            for option, p, q in zip(question.option_ids, served, ref, strict=True):
                difference = abs(p - q)
                if not difference <= self.tolerance:
                    wrong.append({"question": question.question_id, "option": option,
                                  "serving": p, "reference": q})
                    difference = difference if math.isfinite(difference) else 1.0  # NaN: as far off as can be
                largest = max(largest, difference)
        with self._lock:
            self._current = None
            self._histogram.observe(largest)
            self._counts["mismatch" if wrong else "match"] += 1
            if wrong:
                options = [{**o, "serving": _finite(o["serving"]), "reference": _finite(o["reference"])}
                           for o in wrong[:LOGGED_OPTIONS]]
                self._last_mismatch = {"request_id": job.request_id, "max_difference": largest,
                                       "options": options, "at": time.time()}
            mismatches = self._counts["mismatch"]
        if wrong:
            first = wrong[0]
            more = f" (and {len(wrong) - 1} more options)" if len(wrong) > 1 else ""
            log.error(
                "live audit MISMATCH for request %s: question %r option %r: serving path %.6f, "
                "reference %.6f (tolerance %g)%s", job.request_id, first["question"], first["option"],
                first["serving"], first["reference"], self.tolerance, more,
                extra={"request_id": job.request_id, "audit_max_difference": largest,
                       "audit_tolerance": self.tolerance, "audit_options": wrong[:LOGGED_OPTIONS],
                       "audit_mismatched_options": len(wrong)},
            )
            if self.fail_after and mismatches == self.fail_after:
                log.error("live audit: %d mismatches (--audit-fail-ready %d): /ready answers 503 and "
                          "requests are refused until the server is restarted", mismatches, self.fail_after)

    # ---- results (any thread) ----

    def failure(self) -> str | None:
        """Why the server must stop serving (``--audit-fail-ready`` reached), else None."""
        with self._lock:
            mismatches, last = self._counts["mismatch"], self._last_mismatch
        if not self.fail_after or mismatches < self.fail_after or last is None:
            return None
        first = last["options"][0]
        return (f"live audit: {mismatches} requests answered differently from the reference path "
                f"(--audit-fail-ready {self.fail_after}); last: request {last['request_id']} question "
                f"{first['question']!r} option {first['option']!r}: serving path {_show(first['serving'])}, "
                f"reference {_show(first['reference'])} (tolerance {self.tolerance:g})")

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "enabled": True,
                "fraction": self.fraction,
                **self._counts,
                "skipped_because": dict(self._skipped_because),
                "queued": len(self._queue),
                "queued_bytes": self._queue_bytes,
                "running": self._current is not None,
                "tolerance": self.tolerance,
                "fail_ready_after": self.fail_after,
                "failed": bool(self.fail_after) and self._counts["mismatch"] >= self.fail_after,
                "reference_seconds": self._seconds,
                "max_difference": self._histogram.snapshot(),
                "last_mismatch": self._last_mismatch,
            }


def _show(p: float | str) -> str:
    return f"{p:.6f}" if isinstance(p, float) else str(p)


def _finite(p: float) -> float | str:
    return p if math.isfinite(p) else repr(p)  # "nan" stays readable and valid JSON


def disabled_stats() -> dict[str, Any]:
    """``stats()`` of an audit that is off (``--audit-fraction 0``): the same keys, all zero."""
    return {"enabled": False, "fraction": 0.0, **dict.fromkeys(RESULTS, 0), "skipped_because": {},
            "queued": 0, "queued_bytes": 0, "running": False, "tolerance": None, "fail_ready_after": 0,
            "failed": False, "reference_seconds": 0.0, "max_difference": DifferenceHistogram().snapshot(),
            "last_mismatch": None}

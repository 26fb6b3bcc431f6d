"""A DecisionBackend over the serving engine: many requests in flight, batched backbone steps and heads.

Each request is encoded, submitted to the :class:`~clefserve.engine.Engine` with ``(body, record)`` as
payload, and awaited. When records finish in one engine step the head runs once over all of them on the
engine's thread. A client that disconnects has its sequence cancelled, which frees its blocks and slot.
A sample of the answered requests (``--audit-fraction``) is re-run through the reference path in the
engine's idle time (:mod:`clefserve.formats.clef.audit`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, as_completed
from typing import TYPE_CHECKING, Any

import torch

from clefserve.config import EngineConfig
from clefserve.engine import Engine, EngineClosedError, FinishedSequence, QueueFullError
from clefserve.engine.openmp import release_thread_team
from clefserve.engine.python_heap import freeze_loaded_objects
from clefserve.errors import NonFiniteError, RequestError, all_finite
from clefserve.formats.clef.answers import probabilities
from clefserve.formats.clef.audit import Auditor, disabled_stats
from clefserve.formats.clef.decider import ClefDecider
from clefserve.formats.clef.records import QUESTION_TYPES, EncodedRecord
from clefserve.model.inputs import InputsProvider, SequenceInputs

if TYPE_CHECKING:
    from clefserve.server.metrics import Metrics

log = logging.getLogger(__name__)

# How often a waiting request asks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.1
# Fault injection for tests only: a prefix cache that compares token ids alone, so two pictures of one size
# look alike to it (the failure the cache keys prevent); the startup self-check must catch it.
IMAGE_KEYS_FAULT_ENV = "CLEF_FAULT_IMAGE_CACHE_KEYS_IDS_ONLY"


class EngineBackend:
    def __init__(
        self,
        decider: ClefDecider | None,
        config: EngineConfig,
        served_model_name: str,
        *,
        description: str | None = None,
        release_date: dt.date | None = None,
        load: Callable[[], ClefDecider] | None = None,
        memory_budget_bytes: int | None = None,
        self_check: bool = False,
        freeze_heap: bool = False,
    ) -> None:
        """``decider``: ready to use; or ``decider=None`` with ``load``, called off the event loop by
        ``start()`` so the server answers /health (and /ready with 503) while the weights load.
        ``freeze_heap`` (with ``load``): once loaded and checked, freeze the process's objects out of the
        garbage collector's passes (:mod:`clefserve.engine.python_heap`), for a process that serves until it
        exits."""
        if (decider is None) == (load is None):
            raise ValueError("pass either a decider or a load function")
        self.config = config
        self._load = load
        self._budget = memory_budget_bytes
        self._name = served_model_name
        self._description = description or f"Clef decision model {served_model_name}, served by clef-serve"
        self._release_date = release_date or dt.date.today()
        self.decider: ClefDecider | None = None
        self.engine: Engine | None = None
        self._reason = "not started"
        self._metrics: Metrics | None = None
        self._self_check = self_check
        self._check_failure: str | None = None
        self._nonfinite = 0  # records whose hidden rows or logits were NaN/Inf (refused, never answered)
        self._nonfinite_lock = threading.Lock()
        # for GET /v1/status: "not run", "running", "passed" or "failed", when it finished, the first problem
        self._check_result = "not run"
        self._check_finished_at: dt.datetime | None = None
        self._check_problem: str | None = None
        self.audit: Auditor | None = None
        self._serving_ops: str | None = None
        self._freeze_heap = freeze_heap
        if decider is not None:
            self._attach(decider)

    @classmethod
    def loading(cls, load: Callable[[], ClefDecider], config: EngineConfig, served_model_name: str,
                **kwargs: Any) -> EngineBackend:
        return cls(None, config, served_model_name, load=load, **kwargs)

    def _attach(self, decider: ClefDecider) -> None:
        self.engine = Engine(decider.backbone, self.config, self._finish, self._budget)
        self.decider = decider
        # the serving ops, named now: the self-check and the live audit swap the reference ops onto the
        # backbone for a while, and /v1/status must not report those
        self._serving_ops = decider.backbone.ops.name
        c = self.config
        if c.audit_fraction > 0:
            self.audit = Auditor(decider, c.audit_fraction, c.prefill_chunk_size, c.audit_max_queue,
                                 c.audit_queue_mb << 20, c.audit_fail_ready)
            self.engine.set_idle_work(self.audit)
        if self._check_failure is None:
            self._reason = "ready"

    # ---- observability (GET /metrics) ----

    def bind_metrics(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def stats(self) -> dict[str, Any] | None:
        """The engine's counters and pool gauges, the vision tower's, and the live audit's under ``audit``;
        None until the model is loaded."""
        engine, decider = self.engine, self.decider
        if engine is None:
            return None
        audit = self.audit.stats() if self.audit is not None else disabled_stats()
        stats = {**engine.stats(), "nonfinite_outputs": self._nonfinite, "audit": audit}
        if decider is not None and decider.images is not None:
            stats.update(decider.images.encoder.stats())
        return stats

    def takes_images(self) -> bool | None:
        """Whether the model takes images; None while it loads."""
        return self.decider.takes_images if self.decider is not None else None

    def image_support(self) -> dict[str, Any]:
        """For ``GET /v1/status`` and the console: whether requests may carry images, and their limits."""
        decider, config = self.decider, self.config
        if decider is None:
            return {"supported": False, "reason": "the model is loading"}
        if decider.images is None:
            return {"supported": False, "reason": decider.images_refused}
        if config.max_images <= 0:
            return {"supported": False, "reason": "--max-images 0"}
        return {"supported": True, "max_images": config.max_images,
                "max_image_bytes": config.max_image_bytes, "max_image_pixels": config.max_image_pixels,
                "max_body_bytes": config.max_body_bytes + config.image_body_bytes}

    def _failure(self) -> str | None:
        """Why answers must not be served: a failed startup self-check, or too many audit mismatches."""
        if self._check_failure is not None:
            return self._reason
        return self.audit.failure() if self.audit is not None else None

    def status(self) -> dict[str, Any]:
        """For ``GET /v1/status``: the serving phase, the ops and the self-check. Never the load error's text
        (it can hold paths): the log and ``/ready`` have it."""
        engine = self.engine
        if self._check_failure == "load failed":
            phase = "load_failed"
        elif engine is None:
            phase = "loading"
        elif engine.closed or self._reason in ("shutting down", "stopped"):
            phase = "stopped" if engine.closed else "stopping"
        elif self._check_result == "failed":
            phase = "self_check_failed"
        elif self._check_failure is not None:
            phase = "self_check_running"
        elif self.audit is not None and self.audit.failure() is not None:
            phase = "audit_failed"
        else:
            phase = "ready"
        finished = self._check_finished_at
        return {
            "phase": phase,
            "ops": self._serving_ops,
            "self_check": {"result": self._check_result,
                           "finished_at": finished.isoformat(timespec="seconds") if finished else None,
                           "problem": self._check_problem},
        }

    # ---- DecisionBackend ----

    def model_cards(self) -> list[dict[str, Any]]:
        return [{"name": self._name, "description": self._description,
                 "release_date": self._release_date.isoformat()}]

    def question_types(self) -> tuple[str, ...]:
        """What a Clef head answers (its type embedding's rows); ``box`` and others are refused."""
        return tuple(QUESTION_TYPES)

    def ready(self) -> tuple[bool, str]:
        failure = self._failure()
        ok = self.engine is not None and not self.engine.closed and failure is None
        return ok, failure or self._reason

    async def start(self) -> None:
        if self._load is not None and self.engine is None:
            self._reason = "loading the model"
            # Not awaited: the server answers /health and /ready while this runs.
            asyncio.get_running_loop().run_in_executor(None, self._run_load)

    def _run_load(self) -> None:
        try:
            self._load_and_check()
        finally:  # this thread's torch work is done: its idle OpenMP team would slow the engine's
            release_thread_team()

    def _load_and_check(self) -> None:
        assert self._load is not None
        try:
            decider = self._load()
            if self._self_check:  # before the engine exists, so /ready is never 200 ahead of the check
                self._check_failure = "self-check pending"
                self._reason = "running the startup self-check"
            self._attach(decider)
            if self._self_check:
                self.run_self_check()
        except Exception as exc:  # the log and /ready say why; the process stays up, not ready
            log.exception("loading the model failed")
            self._check_failure = "load failed"
            self._reason = f"loading the model failed: {type(exc).__name__}: {exc}"
            return
        if self._freeze_heap:
            freeze_loaded_objects()
        if self._check_failure is None:
            log.info("model %s is ready", self._name)

    def run_self_check(self) -> list[str]:
        """Canary records through the engine (batched, chunked, prefix cache on) against the one-piece
        reference path; on any mismatch the backend stays unready and the log holds both answers.
        Progress (canary i of n, tokens, seconds) and what the engine exercised are logged."""
        from clefserve.formats.clef import canary as canaries_module

        assert self.engine is not None and self.decider is not None
        self._check_failure = "self-check running"
        self._check_result = "running"
        self._reason = "running the startup self-check"
        engine, decider, config = self.engine, self.decider, self.config
        chunk = config.prefill_chunk_size
        canaries, splits = canaries_module.build_canaries(
            decider.encode, chunk, min(config.max_length, engine.kv.token_capacity),
            images=decider.takes_images)
        log.info("startup self-check: %d canaries of %s tokens (%s), each through the engine and the "
                 "reference path", len(canaries), " + ".join(f"{c.tokens:,}" for c in canaries),
                 f"the long one's state of {canaries[0].state_tokens:,} tokens is longer than one "
                 f"--prefill-chunk-size of {chunk}" if splits else
                 f"records never exceed --prefill-chunk-size {chunk}: no chunk splits a state")
        started = time.perf_counter()
        timings: dict[str, float] = {}
        served: list[dict[str, Any]] = []
        steps_before = engine.stats()["steps"]

        def serve(checked: Sequence[canaries_module.Canary]) -> list[dict[str, Any]]:
            # all at once, so that they share steps, but within --max-queue: when it is full, wait for
            # the oldest unfinished canary and try again
            futures: list[Future] = []
            for item in checked:
                while True:
                    try:
                        record, inputs = self._provide(decider, item.record)
                        futures.append(self._submit(engine, item.request, record, True, inputs))
                        break
                    except QueueFullError:
                        pending = [f for f in futures if not f.done()]
                        if pending:
                            pending[0].result()
                        else:
                            time.sleep(0.01)
            index = {future: i for i, future in enumerate(futures)}
            for future in as_completed(futures):
                i = index[future]
                cached = future.result()["usage"].get("x_cached_tokens", 0)
                log.info("self-check %s, serving path: %d tokens (%d from the prefix cache) after %.1f s",
                         canaries_module.label(i, checked), checked[i].tokens, cached,
                         time.perf_counter() - started)
            timings["serving"] = time.perf_counter() - started
            served.extend(future.result() for future in futures)
            return served

        try:
            problems, report = canaries_module.self_check(decider, serve, canaries, decider.backbone.dtype)
        finally:  # the reference path ran on this thread: its idle OpenMP team would slow the engine's
            release_thread_team()
        elapsed = time.perf_counter() - started
        self._check_finished_at = dt.datetime.now(dt.UTC)
        self._check_result = "failed" if problems else "passed"
        self._check_problem = problems[0] if problems else None
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            self._check_failure = problems[0]
            self._reason = f"startup self-check failed: {problems[0]}{more}"
            log.error("startup self-check FAILED, not serving: %s; answers: %s", "; ".join(problems), report)
            return problems
        new_steps = engine.stats()["steps"] - steps_before
        trace = engine.recent_steps()[-new_steps:] if new_steps > 0 else []
        covered = canaries_module.coverage(canaries, served, trace)
        self._check_failure = None
        self._reason = "ready"
        log.info("startup self-check passed (%s ops) in %.1f s (serving path %.1f s, reference path "
                 "%.1f s): %s", decider.backbone.ops.name, elapsed, timings["serving"],
                 elapsed - timings["serving"], covered.summary())
        if splits and not covered.budget_split:
            log.warning("self-check: the engine did not split the long canary inside its state; chunked "
                        "prefill inside a segment was not checked")
        if not covered.shared_state_cached:
            log.warning("self-check: no canary resumed a shared state from the prefix cache%s",
                        " (--no-prefix-cache)" if not config.prefix_cache else "")
        return problems

    @staticmethod
    def _submit(engine: Engine, body: dict[str, Any], record: EncodedRecord, raw: bool,
                inputs: InputsProvider | None = None, request_id: str | None = None) -> Any:
        """``inputs``: what computes the pictures' rows at admission; ``request_id``: a client's request
        sampled for the live audit (None otherwise)."""
        keys = None
        if record.images and not os.environ.get(IMAGE_KEYS_FAULT_ENV):
            keys = record.cache_keys()
        return engine.submit(record.input_ids, payload=(body, record, raw, request_id),
                             snapshot_points=record.resume_points, inputs=inputs, cache_keys=keys)

    def submit(self, body: dict[str, Any]) -> Future:
        """Encode a validated body and queue it without waiting (``clef-serve batch``, ``clefserve.ray``):
        the same encoding, resume points, head and answers as :meth:`decide`. The future resolves to the
        response body. Raises :class:`RequestError` at once for a record that can never run (the 4xx the
        HTTP route would send) or a bad picture, and :class:`EngineClosedError` after shutdown."""
        engine, decider = self.engine, self.decider
        if engine is None or decider is None or self._check_failure is not None:
            raise RequestError(f"the model is not ready: {self._reason}", 503, "unavailable")
        record, inputs = self._prepare(decider, body)
        return self._submit(engine, body, record, self.config.raw_probabilities, inputs)

    @staticmethod
    def _encode(decider: ClefDecider, body: dict[str, Any]) -> EncodedRecord:
        try:
            return decider.encode(body)
        except RequestError as exc:
            if exc.error_type != "tokens_exceeded":
                raise
            # the reference's message, and the flag that raises the limit
            message = f"{exc.message} (this server's --max-length)"
            raise RequestError(message, exc.status, exc.error_type) from None

    async def stop(self) -> None:
        """After the server has drained (uvicorn waits up to --shutdown-grace-s for in-flight requests):
        stop the engine; sequences still in it fail with EngineClosedError."""
        if self.engine is not None:
            self._reason = "shutting down"
            stats = self.engine.stats()
            log.info("stopping the engine (%d running, %d waiting)", stats["running"], stats["waiting"])
            await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)
            self._reason = "stopped"
            log.info("engine stopped")

    async def decide(
        self, body: dict[str, Any], request_id: str, is_disconnected: Callable[[], Awaitable[bool]],
    ) -> dict[str, Any]:
        engine, decider = self.engine, self.decider
        failure = self._failure()
        if engine is None or decider is None or engine.closed or failure is not None:
            raise RequestError(f"the model is not ready: {failure or self._reason}", 503, "unavailable")
        audited = self._audit_sample()
        # decoding and preprocessing run in a worker thread, the vision tower on the engine's thread at
        # admission: never on the event loop
        record, inputs = await asyncio.to_thread(self._prepare, decider, body, audited)
        try:
            future = self._submit(engine, body, record, self.config.raw_probabilities, inputs,
                                  request_id if audited else None)
        except EngineClosedError as exc:
            raise RequestError("the server is shutting down", status=503, error_type="unavailable") from exc
        waiting = asyncio.wrap_future(future)  # cancelling it (task cancelled) cancels the sequence too
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_SECONDS)
                if done:
                    return waiting.result()
                if await is_disconnected():
                    raise RequestError("the client disconnected", status=499, error_type="cancelled")
        finally:
            if not future.done():
                engine.cancel(future)

    def _audit_sample(self) -> bool:
        """Whether the live audit re-runs this request (tossed at submission, so that a sampled request
        with pictures keeps its pixels for the audit's own vision-tower run)."""
        audit = self.audit
        return audit is not None and self._check_failure is None and audit.sample()

    @classmethod
    def _prepare(cls, decider: ClefDecider, body: dict[str, Any],
                 keep_pixels: bool = False) -> tuple[EncodedRecord, InputsProvider | None]:
        """Off the engine's thread (a request's worker thread, ``clef-serve batch``'s reader)."""
        try:
            return cls._provide(decider, cls._encode(decider, body), keep_pixels)
        finally:  # a picture's preparation may have started an OpenMP team on this thread
            release_thread_team()

    @staticmethod
    def _provide(decider: ClefDecider, record: EncodedRecord,
                 keep_pixels: bool = False) -> tuple[EncodedRecord, InputsProvider | None]:
        """The record, and for pictures what computes their rows when the engine admits the sequence (the
        pixels live in it until then, not in the record the head keeps, unless ``keep_pixels``: the audit
        needs them)."""
        if not record.images:
            return record, None
        provider = functools.partial(_picture_inputs, decider, record)
        return (record if keep_pixels else dataclasses.replace(record, prepared_images=())), provider

    # ---- on the engine's thread ----

    def _finish(self, finished: list[FinishedSequence]) -> list[Any]:
        """The head over every record that finished in one engine step, then each record's answer."""
        assert self.decider is not None
        decider = self.decider
        # the non-finite guard: NaN/Inf hidden rows (an f16 overflow, a broken kernel) never reach the head
        finite = [all_finite([f.hidden]) for f in finished]
        good = [f for f, ok in zip(finished, finite, strict=True) if ok]
        records: list[EncodedRecord] = [f.payload[1] for f in good]
        hiddens: list[torch.Tensor] = [f.hidden for f in good]
        try:
            logits: list[Any] = decider.logits(hiddens, records) if good else []
        except Exception:
            # find the record at fault: the others still get their answers
            log.exception("the head failed on a batch of %d records; retrying one by one", len(records))
            logits = [self._one_record(decider, h, r) for h, r in zip(hiddens, records, strict=True)]
        by_record = iter(logits)
        results: list[Any] = []
        for f, ok in zip(finished, finite, strict=True):
            record_logits = next(by_record) if ok else NonFiniteError("the hidden states")
            if not isinstance(record_logits, Exception) and not all_finite(list(record_logits)):
                record_logits = NonFiniteError("the decision head's logits")
            if isinstance(record_logits, NonFiniteError):
                with self._nonfinite_lock:  # the engine's CPU lanes finish steps side by side
                    self._nonfinite += 1
                log.error("sequence %d (%d tokens): %s", f.seq_id, len(f.token_ids), record_logits.message)
            if isinstance(record_logits, Exception):
                results.append(record_logits)
                continue
            body, record, raw, request_id = f.payload
            try:
                results.append(decider.answer(body, record, record_logits, raw, f.cached_tokens))
            except Exception as exc:
                results.append(exc)
                continue
            if request_id is not None:
                self._maybe_audit(request_id, record, record_logits)
        if self._metrics is not None:
            answered = time.perf_counter()
            for f, result in zip(finished, results, strict=True):
                if not isinstance(result, BaseException):
                    self._metrics.observe_decision(f.admitted_at - f.submitted_at, answered - f.admitted_at)
        return results

    def _maybe_audit(self, request_id: str, record: EncodedRecord, logits: Any) -> None:
        """``request_id`` was sampled at submission (:meth:`_audit_sample`)."""
        audit = self.audit
        if audit is None or self._check_failure is not None:
            return
        try:  # the same float32 softmax the answer was rounded from
            audit.offer(request_id, record, probabilities(logits))
        except Exception:  # the audit must never cost a client its answer
            log.exception("could not queue request %s for the live audit", request_id)

    @staticmethod
    def _one_record(decider: ClefDecider, hidden: torch.Tensor, record: EncodedRecord) -> Any:
        try:
            return decider.logits([hidden], [record])[0]
        except Exception as exc:
            return exc


def _picture_inputs(decider: ClefDecider, record: EncodedRecord, start: int) -> SequenceInputs | None:
    return decider.inputs(record, start=start)

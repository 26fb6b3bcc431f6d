"""Prometheus metrics, served by ``GET /metrics`` (open, no auth).

Each app has its own registry (tests build many apps in one process). HTTP metrics are counted by
:class:`MetricsMiddleware`; per-decision latency (queue wait, compute) is observed by the backend when a
sequence finishes; the engine's gauges and counters are read from ``backend.stats()`` at scrape time by
:class:`EngineCollector`, so nothing runs in the background.

Names (all prefixed ``clef_``):

- ``clef_http_requests_total{method,route,status}``: responses by route template ("other" when no route
  matched) and status.
- ``clef_http_request_duration_seconds{route}``: whole request, body intake to response.
- ``clef_http_requests_in_flight``: requests being served now.
- ``clef_request_queue_wait_seconds``: submit to admission into the engine (waiting for a slot and blocks).
- ``clef_request_compute_seconds``: admission to answer (backbone steps, shared with other sequences, + head).
- ``clef_request_errors_total{error_type}``: refused or cut-short decisions by error type: ``overloaded``
  (429, queue full), ``cancelled`` (client went away), ``tokens_exceeded``, ``unavailable``, ...
- engine (at scrape time): ``clef_engine_running_sequences``, ``clef_engine_waiting_sequences`` (queue
  depth), ``clef_engine_kv_blocks_used`` (held by sequences in flight) / ``_cached`` (held only by the prefix
  cache, evictable) / ``_total``, ``clef_engine_gdn_slots_used`` / ``_total``,
  ``clef_engine_kv_pool_bytes``, ``clef_engine_gdn_pool_bytes``, ``clef_engine_tokens_per_second``,
  ``clef_engine_prefill_tokens_total``, ``clef_engine_steps_total``, ``clef_engine_paused_steps_total``,
  ``clef_engine_held_steps_total``, ``clef_engine_side_steps_total``, ``clef_engine_sequences_total{outcome}``
  (finished, cancelled, failed, rejected); with the prefix cache on ``clef_engine_prefix_cache_bytes`` /
  ``_budget_bytes``, ``clef_engine_prefix_cache_hits_total``, ``_hit_tokens_total``, ``_evictions_total``;
  ``clef_model_ready`` (1 once the model serves); ``clef_nonfinite_outputs_total``: records refused because
  the model computed NaN/Inf for them (hidden rows or head logits; also counted as
  ``clef_request_errors_total{error_type="non_finite_output"}``, a 500).
- vision (releases with a vision tower): ``clef_vision_images_encoded_total``, ``_patches_encoded_total``,
  ``_encode_seconds_total``, and the encoder cache's ``clef_vision_encoder_cache_hits_total`` /
  ``_misses_total`` / ``_evictions_total`` / ``_bytes`` / ``_budget_bytes``.
- live audit (at scrape time, from ``stats()["audit"]``):
  ``clef_audit_total{result="match|mismatch|skipped"}``, ``clef_audit_max_probability_difference``
  (histogram of the largest option difference per audited request), ``clef_audit_queued`` (samples waiting
  for idle time).
- ``clef_python_gc_pause_seconds{generation}``: each pass of Python's garbage collector (all threads stop,
  the engine's included; ``clefserve.engine.python_heap``); ``clef_python_gc_frozen_objects``: objects frozen
  out of its passes once the model was loaded.
- ``process_*``: the process collector (resident memory, CPU seconds, open fds).

``Metrics.recent`` (not exported: Prometheus computes rates itself) keeps the last minute of decision
requests (POST routes) for ``GET /v1/status``: requests per second and p50/p95 latency.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clefserve.engine.python_heap import PAUSE_BUCKETS, collector_pauses
from clefserve.server.rolling import RollingWindow

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds: probes answer in a millisecond, a long record on a CPU can take a minute.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0)
UNMATCHED_ROUTE = "other"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # else "other"

StatsFn = Callable[[], dict[str, Any] | None]


class Metrics:
    def __init__(self, stats: StatsFn | None = None, ready: Callable[[], bool] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("clef_http_requests", "HTTP responses by route template and status",
                                ["method", "route", "status"], registry=r)
        self.duration = Histogram("clef_http_request_duration_seconds",
                                  "Whole HTTP request, body intake to response", ["route"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("clef_http_requests_in_flight", "HTTP requests being served", registry=r)
        self.queue_wait = Histogram("clef_request_queue_wait_seconds",
                                    "Decision: submitted to the engine until admitted (slot and KV blocks)",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.compute = Histogram("clef_request_compute_seconds",
                                 "Decision: admitted until answered (backbone steps and head)",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.errors = Counter("clef_request_errors", "Decisions refused or cut short, by error type",
                              ["error_type"], registry=r)
        ProcessCollector(registry=r)
        self.engine = EngineCollector(stats, ready)
        r.register(self.engine)
        collector_pauses.install()
        r.register(PythonHeapCollector())
        self.recent = RollingWindow()

    def observe_decision(self, queue_wait_s: float, compute_s: float) -> None:
        """Thread-safe: called on the engine's thread when a decision is answered."""
        self.queue_wait.observe(max(0.0, queue_wait_s))
        self.compute.observe(max(0.0, compute_s))

    def count_error(self, error_type: str) -> None:
        self.errors.labels(error_type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """The engine's pools and counters, read from ``stats()`` (one short lock) when scraped."""

    def __init__(self, stats: StatsFn | None, ready: Callable[[], bool] | None) -> None:
        self._stats = stats
        self._ready = ready

    def describe(self) -> list[Metric]:
        return []  # dynamic: nothing to check against other collectors at registration

    def collect(self) -> Iterator[Metric]:
        if self._ready is not None:
            try:
                ready = bool(self._ready())
            except Exception:
                ready = False
            yield GaugeMetricFamily("clef_model_ready", "1 when the model is loaded and serving",
                                    value=int(ready))
        try:
            s = self._stats() if self._stats is not None else None
        except Exception:  # a scrape must not fail because the engine is gone
            log.exception("reading engine stats failed")
            s = None
        if not s:
            return

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge("clef_engine_running_sequences", "Sequences admitted and running", s["running"])
        yield gauge("clef_engine_waiting_sequences", "Sequences queued for admission (queue depth)",
                    s["waiting"])
        cache_only = s.get("prefix_blocks_cache_only", 0)
        yield gauge("clef_engine_kv_blocks_used", "Paged KV blocks held by sequences in flight",
                    s["kv_blocks_total"] - s["kv_blocks_free"] - cache_only)
        yield gauge("clef_engine_kv_blocks_cached", "Paged KV blocks held only by the prefix cache "
                    "(evictable)", cache_only)
        yield gauge("clef_engine_kv_blocks_total", "Paged KV blocks in the pool", s["kv_blocks_total"])
        yield gauge("clef_engine_gdn_slots_used", "GDN state slots held by sequences",
                    s["gdn_slots_total"] - s["gdn_slots_free"])
        yield gauge("clef_engine_gdn_slots_total", "GDN state slots in the pool", s["gdn_slots_total"])
        yield gauge("clef_engine_kv_pool_bytes", "Bytes of the paged KV pool", s["kv_bytes"])
        yield gauge("clef_engine_gdn_pool_bytes", "Bytes of the GDN state pool", s["gdn_bytes"])
        yield gauge("clef_engine_tokens_per_second", "Recent prefill throughput (moving average)",
                    s["tokens_per_second"])
        yield CounterMetricFamily("clef_engine_prefill_tokens", "Tokens run through the backbone",
                                  value=s["prefill_tokens"])
        yield CounterMetricFamily("clef_engine_steps", "Engine steps (one batched forward each)",
                                  value=s["steps"])
        yield CounterMetricFamily("clef_engine_paused_steps", "Steps of long records paused at a layer "
                                  "boundary while a step of short records that arrived during them ran",
                                  value=s.get("paused_steps", 0))
        yield CounterMetricFamily("clef_engine_held_steps", "Times a step of long records on one CPU lane "
                                  "held, at a layer boundary or its start, while a step of short records ran "
                                  "on the other", value=s.get("held_steps", 0))
        yield CounterMetricFamily("clef_engine_side_steps", "Steps run on the second CPU lane, beside a step "
                                  "of the first", value=s.get("side_steps", 0))
        if s.get("prefix_cache"):
            yield gauge("clef_engine_prefix_cache_bytes", "Bytes the prefix cache holds (of its budget)",
                        s.get("prefix_cache_bytes", 0))
            yield gauge("clef_engine_prefix_cache_budget_bytes", "The prefix cache's byte budget",
                        s.get("prefix_cache_budget_bytes", 0))
            yield CounterMetricFamily("clef_engine_prefix_cache_hits",
                                      "Sequences resumed from a cached prefix", value=s.get("prefix_hits", 0))
            yield CounterMetricFamily("clef_engine_prefix_cache_hit_tokens",
                                      "Prompt tokens not computed thanks to the prefix cache",
                                      value=s.get("prefix_hit_tokens", 0))
            yield CounterMetricFamily("clef_engine_prefix_cache_evictions", "Prefix cache entries evicted",
                                      value=s.get("prefix_evictions", 0))
        if "nonfinite_outputs" in s:
            yield CounterMetricFamily("clef_nonfinite_outputs", "Records refused because the model computed "
                                      "NaN/Inf for them (hidden rows or head logits)",
                                      value=s["nonfinite_outputs"])
        outcomes = CounterMetricFamily("clef_engine_sequences", "Sequences by how they left the engine",
                                       labels=["outcome"])
        for outcome in ("finished", "cancelled", "failed", "rejected"):
            outcomes.add_metric([outcome], s[outcome])
        yield outcomes
        if "images_encoded" in s:  # a release with a vision tower
            yield from _vision_metrics(s)
        if "audit" in s:
            yield from audit_metrics(s["audit"])


class PythonHeapCollector:
    """The garbage collector's pauses (recorded process-wide) and the frozen objects, when scraped."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        pauses = HistogramMetricFamily("clef_python_gc_pause_seconds", "Passes of Python's garbage collector "
                                       "by generation: every thread stops for each, the engine's too",
                                       labels=["generation"])
        for generation, record in enumerate(collector_pauses.generations):
            bounds = zip(PAUSE_BUCKETS, record.within, strict=True)
            buckets = [*((repr(bound), within) for bound, within in bounds), ("+Inf", record.count)]
            pauses.add_metric([str(generation)], buckets, sum_value=record.seconds)
        yield pauses
        yield GaugeMetricFamily("clef_python_gc_frozen_objects", "Objects frozen out of the garbage "
                                "collector's passes once the model was loaded", value=gc.get_freeze_count())


def _vision_metrics(s: dict[str, Any]) -> Iterator[Metric]:
    yield CounterMetricFamily("clef_vision_images_encoded", "Pictures run through the vision tower",
                              value=s["images_encoded"])
    yield CounterMetricFamily("clef_vision_patches_encoded", "Patches run through the vision tower",
                              value=s["patches_encoded"])
    yield CounterMetricFamily("clef_vision_encode_seconds", "Time spent in the vision tower",
                              value=s["vision_seconds"])
    if "encoder_cache_hits" in s:
        yield CounterMetricFamily("clef_vision_encoder_cache_hits",
                                  "Pictures whose tower rows came from the encoder cache",
                                  value=s["encoder_cache_hits"])
        yield CounterMetricFamily("clef_vision_encoder_cache_misses", "Pictures the encoder cache lacked",
                                  value=s["encoder_cache_misses"])
        yield CounterMetricFamily("clef_vision_encoder_cache_evictions", "Encoder cache entries evicted",
                                  value=s["encoder_cache_evictions"])
        yield GaugeMetricFamily("clef_vision_encoder_cache_bytes", "Bytes the encoder cache holds",
                                value=s["encoder_cache_bytes"])
        yield GaugeMetricFamily("clef_vision_encoder_cache_budget_bytes", "The encoder cache's byte budget "
                                "(--image-cache-mb)", value=s["encoder_cache_budget_bytes"])


def audit_metrics(audit: dict[str, Any]) -> Iterator[Metric]:
    """The live audit's counters and histogram (clefserve.formats.clef.audit), also when it is off."""
    results = CounterMetricFamily("clef_audit", "Answered requests sampled by the live audit, by result "
                                  "against the reference path", labels=["result"])
    for result in ("match", "mismatch", "skipped"):
        results.add_metric([result], audit[result])
    yield results
    histogram = audit["max_difference"]
    buckets = [(bound if isinstance(bound, str) else repr(bound), count)
               for bound, count in histogram["buckets"]]
    yield HistogramMetricFamily("clef_audit_max_probability_difference",
                                "Largest |serving - reference| option probability per audited request",
                                buckets=buckets, sum_value=histogram["sum"])
    yield GaugeMetricFamily("clef_audit_queued", "Sampled requests waiting for idle engine time",
                            value=audit["queued"])


class MetricsMiddleware:
    """Counts every HTTP response by route template and status, and times it (pure ASGI)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        started = time.perf_counter()

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        m = self.metrics
        m.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_status)
        except Exception:
            status = status or 500
            raise
        finally:
            m.in_flight.dec()
            route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
            # 0: no response started (the client left, or the task was cancelled at shutdown)
            method = scope["method"] if scope["method"] in METHODS else UNMATCHED_ROUTE
            m.requests.labels(method, route, str(status) if status else "none").inc()
            elapsed = time.perf_counter() - started
            m.duration.labels(route).observe(elapsed)
            if method == "POST" and route != UNMATCHED_ROUTE:  # decisions: the only POST routes
                m.recent.record(elapsed, ok=0 < status < 400)

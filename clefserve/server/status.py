"""``GET /v1/status``: the engine at a glance, as JSON, for the console and for people with ``curl``.

It reads the same values ``GET /metrics`` exports (the engine collector, the HTTP counters), plus the last
minute of decision requests (:class:`~clefserve.server.rolling.RollingWindow`), what the backend says about
its self-check, and the backend's audit counters when it reports them (``stats()["audit"]``). It never holds
a path, a key, an environment variable or an error text (load errors can hold paths; the log has them).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from clefserve import __version__
from clefserve.config import EngineConfig
from clefserve.server.metrics import Metrics

log = logging.getLogger(__name__)

NO_IMAGES = {"supported": False, "reason": "the model takes no images"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerStatus(_Strict):
    version: str
    uptime_s: float
    auth_required: bool = Field(description="whether the API needs 'Authorization: Bearer KEY'")


class SelfCheckStatus(_Strict):
    result: str = Field(description="'not run', 'running', 'passed' or 'failed'")
    finished_at: str | None = Field(description="when it finished (UTC, ISO 8601)")
    problem: str | None = Field(description="the first mismatching canary, when it failed")


class ModelStatus(_Strict):
    name: str | None
    ready: bool
    phase: str = Field(description="'loading', 'self_check_running', 'ready', 'self_check_failed', "
                       "'load_failed', 'stopping' or 'stopped'")
    dtype: str
    device: str = Field(description="'cpu' or 'cuda:N'")
    device_name: str | None = Field(None, description="the GPU's name, on a GPU")
    ops: str | None = Field(description="the kernel set the backbone runs")
    max_length: int
    self_check: SelfCheckStatus | None


class Used(_Strict):
    used: int
    total: int


class KvBlocks(_Strict):
    used: int = Field(description="held by sequences in flight")
    cached: int = Field(description="held only by the prefix cache (evictable)")
    total: int


class PrefixCacheStatus(_Strict):
    hits: int = Field(description="sequences resumed from a cached prefix")
    hit_tokens: int = Field(description="prompt tokens not computed thanks to the cache")
    token_hit_rate: float | None = Field(description="hit_tokens / (hit_tokens + computed tokens)")
    bytes: int
    budget_bytes: int
    evictions: int


class EncoderCacheStatus(_Strict):
    hits: int = Field(description="pictures whose vision-tower rows came from the cache")
    misses: int
    hit_rate: float | None = Field(description="hits / (hits + misses)")
    bytes: int
    budget_bytes: int = Field(description="--image-cache-mb")
    evictions: int


class VisionStatus(_Strict):
    images_encoded: int = Field(description="pictures run through the vision tower")
    patches_encoded: int
    encode_seconds: float = Field(description="time spent in the vision tower")
    encoder_cache: EncoderCacheStatus | None = Field(description="null when --image-cache-mb is 0")


class EngineStatus(_Strict):
    running: int
    waiting: int
    max_num_seqs: int
    max_queue: int
    kv_blocks: KvBlocks
    kv_pool_bytes: int
    gdn_slots: Used
    gdn_pool_bytes: int
    tokens_per_second: float
    prefill_tokens: int
    steps: int
    sequences: dict[str, int] = Field(description="finished, cancelled, failed, rejected")
    prefix_cache: PrefixCacheStatus | None = Field(description="null when the prefix cache is off")
    vision: VisionStatus | None = Field(None, description="the vision tower and its encoder cache; null "
                                        "for a model without one")


class SecondPoint(_Strict):
    t: int = Field(description="seconds relative to now (0 = the current second)")
    count: int
    errors: int
    p50_ms: float | None
    p95_ms: float | None


class LastMinute(_Strict):
    window_s: int
    count: int
    errors: int = Field(description="answered with a status >= 400")
    per_second: float
    p50_ms: float | None = Field(description="of the successful requests")
    p95_ms: float | None
    series: list[SecondPoint]


class RequestStatus(_Strict):
    total: int = Field(description="decision requests (POST) answered since the start")
    by_status: dict[str, int] = Field(description="by status class: 2xx, 4xx, 5xx")
    errors: dict[str, int] = Field(description="decisions refused or cut short, by error_type")
    last_minute: LastMinute


class ImageSupport(_Strict):
    supported: bool
    reason: str | None = Field(None, description="why not, when not supported")
    max_images: int | None = None
    max_image_bytes: int | None = None
    max_image_pixels: int | None = None
    max_body_bytes: int | None = Field(None, description="the largest body with images (--max-body-bytes "
                                       "bounds the rest)")


class Limits(_Strict):
    max_body_bytes: int
    max_questions: int
    max_choice_labels: int
    max_score_levels: int


class StatusResponse(_Strict):
    server: ServerStatus
    model: ModelStatus
    engine: EngineStatus | None = Field(description="null until the model is loaded")
    requests: RequestStatus
    limits: Limits
    images: ImageSupport
    audit: dict[str, float | int | str | bool | None] | None = Field(
        None, description="live audit counters, present only when the audit runs")


def _gpu_name(device: str) -> str | None:
    if not device.startswith("cuda"):
        return None
    try:
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    except Exception:
        return None


def _collected(metrics: Metrics) -> dict[str, float]:
    """The engine collector's samples, keyed ``name`` or ``name{label}``."""
    values: dict[str, float] = {}
    try:
        for family in metrics.engine.collect():
            for sample in family.samples:
                labels = ",".join(sample.labels.values())
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    except Exception:  # the status must not fail because one part of it did
        log.exception("reading the engine's metrics failed while building /v1/status")
    return values


def _counter(counter: Any) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for family in counter.collect() for s in family.samples
            if s.name.endswith("_total")]


def _engine(v: dict[str, float], config: EngineConfig) -> dict[str, Any] | None:
    if "clef_engine_running_sequences" not in v:
        return None

    def n(name: str) -> int:
        return int(v.get(name, 0))

    prefix = None
    if "clef_engine_prefix_cache_bytes" in v:
        hit = n("clef_engine_prefix_cache_hit_tokens_total")
        computed = n("clef_engine_prefill_tokens_total")
        prefix = {"hits": n("clef_engine_prefix_cache_hits_total"), "hit_tokens": hit,
                  "token_hit_rate": round(hit / (hit + computed), 4) if hit + computed else None,
                  "bytes": n("clef_engine_prefix_cache_bytes"),
                  "budget_bytes": n("clef_engine_prefix_cache_budget_bytes"),
                  "evictions": n("clef_engine_prefix_cache_evictions_total")}
    vision = None
    if "clef_vision_images_encoded_total" in v:
        cache = None
        if "clef_vision_encoder_cache_bytes" in v:
            hits = n("clef_vision_encoder_cache_hits_total")
            misses = n("clef_vision_encoder_cache_misses_total")
            cache = {"hits": hits, "misses": misses,
                     "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
                     "bytes": n("clef_vision_encoder_cache_bytes"),
                     "budget_bytes": n("clef_vision_encoder_cache_budget_bytes"),
                     "evictions": n("clef_vision_encoder_cache_evictions_total")}
        vision = {"images_encoded": n("clef_vision_images_encoded_total"),
                  "patches_encoded": n("clef_vision_patches_encoded_total"),
                  "encode_seconds": round(v.get("clef_vision_encode_seconds_total", 0.0), 3),
                  "encoder_cache": cache}
    return {
        "running": n("clef_engine_running_sequences"),
        "waiting": n("clef_engine_waiting_sequences"),
        "max_num_seqs": config.max_num_seqs,
        "max_queue": config.max_queue,
        "kv_blocks": {"used": n("clef_engine_kv_blocks_used"), "cached": n("clef_engine_kv_blocks_cached"),
                      "total": n("clef_engine_kv_blocks_total")},
        "kv_pool_bytes": n("clef_engine_kv_pool_bytes"),
        "gdn_slots": {"used": n("clef_engine_gdn_slots_used"), "total": n("clef_engine_gdn_slots_total")},
        "gdn_pool_bytes": n("clef_engine_gdn_pool_bytes"),
        "tokens_per_second": round(v.get("clef_engine_tokens_per_second", 0.0), 1),
        "prefill_tokens": n("clef_engine_prefill_tokens_total"),
        "steps": n("clef_engine_steps_total"),
        "sequences": {o: n(f"clef_engine_sequences_total{{{o}}}")
                      for o in ("finished", "cancelled", "failed", "rejected")},
        "prefix_cache": prefix,
        "vision": vision,
    }


def _requests(metrics: Metrics) -> dict[str, Any]:
    by_status: dict[str, int] = {}
    for labels, value in _counter(metrics.requests):
        if labels["method"] == "POST" and labels["route"] != "other":
            status = labels["status"]
            key = f"{status[0]}xx" if status[:1].isdigit() else status
            by_status[key] = by_status.get(key, 0) + int(value)
    errors = {labels["error_type"]: int(value) for labels, value in _counter(metrics.errors)}
    return {"total": sum(by_status.values()), "by_status": by_status, "errors": errors,
            "last_minute": metrics.recent.summary()}


def _scalars(value: Any, prefix: str = "") -> dict[str, Any]:
    """A stats dict flattened to ``a.b`` keys with JSON scalar values (anything else is left out)."""
    out: dict[str, Any] = {}
    if not isinstance(value, dict):
        return out
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, dict):
            out.update(_scalars(item, f"{name}."))
        elif item is None or isinstance(item, bool | int | float | str):
            out[name] = item
    return out


class StatusReporter:
    """Builds the ``GET /v1/status`` body for one app."""

    def __init__(self, backend: Any, config: EngineConfig, metrics: Metrics) -> None:
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.started = time.monotonic()
        self.device = str(config.torch_device) if config.device == "cpu" or config.device.isdigit() \
            else config.device
        self.device_name = _gpu_name(self.device)

    def _call(self, name: str) -> Any:
        method = getattr(self.backend, name, None)
        if method is None:
            return None
        try:
            return method()
        except Exception:  # the status page must not fail because one part of it did
            log.exception("backend.%s() failed while building /v1/status", name)
            return None

    def report(self) -> dict[str, Any]:
        ready = self._call("ready") or (False, "")
        own = self._call("status") or {}
        cards = self._call("model_cards") or [{}]
        stats = self._call("stats") or {}
        images = self._call("image_support") or NO_IMAGES
        config = self.config
        body: dict[str, Any] = {
            "server": {"version": __version__, "uptime_s": round(time.monotonic() - self.started, 1),
                       "auth_required": bool(config.api_key)},
            "model": {
                "name": cards[0].get("name"), "ready": bool(ready[0]),
                "phase": own.get("phase", "ready" if ready[0] else "loading"),
                "dtype": config.dtype, "device": self.device, "device_name": self.device_name,
                "ops": own.get("ops"), "max_length": config.max_length, "self_check": own.get("self_check"),
            },
            "engine": _engine(_collected(self.metrics), config),
            "requests": _requests(self.metrics),
            "limits": {"max_body_bytes": config.max_body_bytes, "max_questions": config.max_questions,
                       "max_choice_labels": config.max_choice_labels,
                       "max_score_levels": config.max_score_levels},
            "images": {k: images.get(k) for k in ImageSupport.model_fields if k in images},
        }
        audit = stats.get("audit") if isinstance(stats, dict) else None
        if audit and audit.get("enabled", True):  # --audit-fraction 0: no audit, no panel
            body["audit"] = _scalars(audit)
        return body

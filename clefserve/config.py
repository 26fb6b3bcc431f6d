"""EngineConfig: one dataclass for every command-line flag, with the flag spellings it accepts.

The short spellings are candle-vllm's, so the operators' Deployment args work unchanged:
``--w DIR --d 0 --dtype f16 --p 8080 --max-num-seqs 4 --kv-fraction 0.30 --prefill-chunk-size 1024``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from clefserve.confidence import CONFIDENCE_MODES
from clefserve.formats.clef.encoder import QUESTION_ID_MODES

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class EngineConfig:
    weights: str | None = None
    device: str = "cpu"
    dtype: str = "f32"
    host: str = "0.0.0.0"
    port: int = 8080
    served_model_name: str | None = None
    max_num_seqs: int = 8
    kv_fraction: float = 0.30
    kv_cache_mb: int | None = None
    prefill_chunk_size: int = 1024
    block_size: int = 16
    max_queue: int = 256
    max_length: int = 16384
    prefix_cache: bool = True
    prefix_cache_mb: int = 512
    layer_preemption: bool = True
    cpu_lanes: int = 2
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_images: int = 4
    max_image_bytes: int = 5 << 20
    max_image_pixels: int = 40_000_000
    image_cache_mb: int = 256
    raw_probabilities: bool = False
    log_level: str = "info"
    shutdown_grace_s: float = 30.0
    kernels: str = "auto"
    console: bool = True
    confidence: str = "clef"
    question_ids: str = "prompt"
    max_questions: int = 64
    max_choice_labels: int = 255
    max_score_levels: int = 10
    audit_fraction: float = 0.01
    audit_fail_ready: int = 0
    audit_max_queue: int = 64
    audit_queue_mb: int = 64

    @property
    def image_body_bytes(self) -> int:
        """What ``--max-images`` pictures of ``--max-image-bytes`` each add to a body, base64-encoded."""
        from clefserve.vision.decode import max_text_length

        return self.max_images * max_text_length(self.max_image_bytes)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        """``--d cpu`` or a GPU index (``--d 0``)."""
        if self.device == "cpu":
            return torch.device("cpu")
        return torch.device(f"cuda:{int(self.device)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        values: dict[str, Any] = {k: v for k, v in vars(args).items() if k in names}
        if values.get("api_key") is None:
            values["api_key"] = os.environ.get("CLEF_API_KEY") or None
        return cls(**values)


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its error message
    return parse


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    model = parser.add_argument_group("model")
    model.add_argument(
        "--w",
        "--weights",
        dest="weights",
        metavar="DIR",
        help="release folder: config.json, model safetensors, tokenizer.json, joint_head.safetensors and "
        "joint_head_config.json (default: the embedded demo model clef-demo, a tiny support-ticket "
        "triage model for trying the server out)",
    )
    model.add_argument(
        "--d",
        "--device",
        dest="device",
        default=d.device,
        metavar="DEV",
        help="'cpu' or a GPU index such as 0 (default: %(default)s)",
    )
    model.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=d.dtype,
        help="weight and activation dtype; gates, norms and the recurrent state stay fp32; f16 for a V100, "
        "which has no bf16 (refused there at startup). On a CPU without bf16/f16 instructions (AVX512_BF16, "
        "AMX) projections compute in fp32, rounded to the dtype (default: %(default)s)",
    )
    model.add_argument(
        "--served-model-name",
        default=d.served_model_name,
        metavar="NAME",
        help="name listed by /v1/models (default: the folder name; clef-demo for the demo model)",
    )
    model.add_argument(
        "--max-length",
        type=int,
        default=d.max_length,
        metavar="TOKENS",
        help="longest record; the state is cut to fit, the schema never (default: %(default)s)",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--h", "--host", dest="host", default=d.host, help="bind address (default: %(default)s)"
    )
    server.add_argument(
        "--p", "--port", dest="port", type=int, default=d.port, help="port (default: %(default)s)"
    )
    server.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (or set CLEF_API_KEY); default: no auth",
    )
    server.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="larger request bodies get 413, not counting the base64 images of a request (see --max-images) "
        "(default: %(default)s)",
    )
    server.add_argument(
        "--max-questions",
        type=_at_least(1),
        default=d.max_questions,
        metavar="N",
        help="most questions in one request; more is a 422 naming this flag (default: %(default)s, hosted "
        "Clef's limit; TypeSafe states none)",
    )
    server.add_argument(
        "--max-choice-labels",
        type=_at_least(2),
        default=d.max_choice_labels,
        metavar="N",
        help="most labels of one choice question (default: %(default)s, TypeSafe's limit)",
    )
    server.add_argument(
        "--max-score-levels",
        type=_at_least(2),
        default=d.max_score_levels,
        metavar="N",
        help="most levels of one score question (default: %(default)s, TypeSafe's limit)",
    )
    images = parser.add_argument_group(
        "images", "requests with images (releases with a vision tower); a body may hold --max-images "
        "base64 images of --max-image-bytes each on top of --max-body-bytes")
    images.add_argument("--max-images", type=int, default=d.max_images, metavar="N",
                        help="images per request; more get 422 (default: %(default)s; 0 refuses images)")
    images.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes, metavar="BYTES",
                        help="largest image file (PNG, JPEG, WebP, GIF, BMP) before base64; larger ones get "
                        "413 (default: %(default)s)")
    images.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels, metavar="PIXELS",
                        help="largest picture, width x height as its header declares, refused (413) before "
                        "decoding: decompression bombs never expand (default: %(default)s)")
    images.add_argument("--image-cache-mb", type=int, default=d.image_cache_mb, metavar="MB",
                        help="byte budget of the encoder cache: vision-tower rows of recent pictures, so a "
                        "picture several requests share is encoded once; 0 turns it off "
                        "(default: %(default)s)")
    server.add_argument("--x-raw-probabilities", dest="raw_probabilities", action="store_true",
                        help="add x_probabilities (unrounded fp32 probabilities) to each answer, for audits")
    server.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"],
                        help="JSON log lines on stderr at this level and above (default: %(default)s)")
    server.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=d.shutdown_grace_s,
        metavar="S",
        help="on SIGTERM: stop accepting, let in-flight requests finish for up to S seconds, then stop the "
        "engine and exit 0 (keep Kubernetes' terminationGracePeriodSeconds above it) (default: %(default)s)",
    )
    server.add_argument("--no-console", dest="console", action="store_false",
                        help="do not serve the browser console at / (GET /v1/status stays)")
    semantics = parser.add_argument_group("semantics (README \"Semantics\": where Clef and TypeSafe differ)")
    semantics.add_argument(
        "--confidence",
        choices=CONFIDENCE_MODES,
        default=d.confidence,
        help="confidence of choice and score answers: 'clef' = the top probability, as Cloudflare's "
        "reference; 'typesafe' = TypeSafe's documented formulas ((m - 1/n)/(1 - 1/n) for a choice, "
        "1 - spread around the mode / a uniform answer's spread for a score) (default: %(default)s)",
    )
    semantics.add_argument(
        "--question-ids",
        choices=QUESTION_ID_MODES,
        default=d.question_ids,
        help="'prompt' = write each question id into the model's record, as Cloudflare's encoding (renaming "
        "a question can change its answer); 'opaque' = write positional names q1, q2, ... instead, so "
        "ids never reach the model (not what the model was trained on: accuracy may differ) "
        "(default: %(default)s)",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--kernels",
        choices=["auto", "fast", "reference"],
        default=d.kernels,
        help="op implementations: auto = the fastest this device supports, falling back op by op to the "
        "torch ops (on a GPU: flash-linear-attention's Triton kernels and fused SDPA attention, each probed "
        "against the reference first); fast = the fused kernels or a startup error (on a CPU: fla under "
        "Triton's interpreter, TRITON_INTERPRET=1, for tests); reference = the plain torch ops. The startup "
        "log lists the choice per op and why (default: %(default)s)",
    )
    engine.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        metavar="N",
        help="sequences running at once; each holds one GDN state slot (default: %(default)s)",
    )
    engine.add_argument(
        "--kv-fraction",
        type=float,
        default=d.kv_fraction,
        metavar="F",
        help="share of the memory left after loading the weights that the paged KV pool takes "
        "(GPU: free device memory less the activation peak of a warm-up --prefill-chunk-size step; CPU: "
        "available RAM, capped by the container's memory limit, less the file-mapped weights; both less the "
        "hidden rows of --max-num-seqs records) "
        "(default: %(default)s)",
    )
    engine.add_argument(
        "--kv-cache-mb",
        type=int,
        default=d.kv_cache_mb,
        metavar="MB",
        help="explicit KV pool size in MiB; overrides --kv-fraction",
    )
    engine.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=d.prefill_chunk_size,
        metavar="TOKENS",
        help="token budget of one engine step, shared by the running sequences; "
        "longer records run over several steps (default: %(default)s)",
    )
    engine.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        metavar="TOKENS",
        help="tokens per KV block (default: %(default)s)",
    )
    engine.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        metavar="N",
        help="requests waiting beyond this get 429 with Retry-After (default: %(default)s)",
    )
    engine.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="turn the prefix cache off (on by default)",
    )
    engine.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=d.prefix_cache_mb,
        metavar="MB",
        help="byte budget of the prefix cache, at most half of the memory the pools leave free "
        "(default: %(default)s)",
    )
    engine.add_argument(
        "--no-layer-preemption",
        dest="layer_preemption",
        action="store_false",
        help="let a step of long records run to its end before short records that arrived during it; by "
        "default it pauses at the next layer boundary, a step of those short records runs, and it resumes "
        "(with CPU lanes, a long step on the other lane also holds at its next boundary while it runs)",
    )
    engine.add_argument(
        "--cpu-lanes",
        type=int,
        choices=(1, 2),
        default=d.cpu_lanes,
        metavar="N",
        help="on a CPU with 2 or more intra-op threads: up to N engine steps at once, each on its own worker "
        "thread over other records, sharing the threads (a step alone gets them all); 1 runs one step at a "
        "time (default: %(default)s; a GPU runs one)",
    )
    audit = parser.add_argument_group(
        "live audit",
        "a random sample of answered requests is re-run through the plain torch reference path while the "
        "engine is idle, and its unrounded probabilities compared with the served ones at the startup "
        "self-check's tolerance (metrics clef_audit_total{result} and clef_audit_max_probability_difference)",
    )
    audit.add_argument(
        "--audit-fraction",
        type=_fraction,
        default=d.audit_fraction,
        metavar="F",
        help="share of answered requests to audit, 0 to 1; 0 turns the audit off (default: %(default)s)",
    )
    audit.add_argument(
        "--audit-fail-ready",
        type=_non_negative_int,
        default=d.audit_fail_ready,
        metavar="N",
        help="after N audit mismatches /ready answers 503 with the reason and requests get 503, until a "
        "restart; 0 only counts and logs them (default: %(default)s)",
    )
    audit.add_argument(
        "--audit-max-queue",
        type=_positive_int,
        default=d.audit_max_queue,
        metavar="N",
        help="sampled requests waiting for idle time; beyond it the oldest are dropped and counted as "
        "skipped (default: %(default)s)",
    )
    audit.add_argument(
        "--audit-queue-mb",
        type=_positive_int,
        default=d.audit_queue_mb,
        metavar="MB",
        help="memory bound of that queue (the records' token ids) (default: %(default)s)",
    )


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {text}")
    return value

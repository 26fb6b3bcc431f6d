"""Shared pieces of the engine tests: backbone specs, engine configs, and a finish callback that pauses."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import torch

from clefserve.config import EngineConfig
from clefserve.engine import FinishedSequence
from clefserve.testing.release import ReleaseSpec
from tests.backbone_specs import BACKBONE_SPECS

L, F = "linear_attention", "full_attention"

# 3:1 default; two attention layers with one KV head and a conv kernel of 3; a tied CausalLM folder; decays as
# strong as Qwen3.5's.
ENGINE_SPECS = {
    "default": ReleaseSpec(head=None),
    "two-attn": ReleaseSpec(
        head=None,
        num_hidden_layers=6,
        layer_types=[L, F, L, L, F, L],
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        num_key_value_heads=1,
        head_dim=32,
        linear_conv_kernel_dim=3,
    ),
    "causal-lm": BACKBONE_SPECS["causal-lm-tied"],
    "qwen-decays": BACKBONE_SPECS["qwen-decays"],
}


def small_config(**overrides) -> EngineConfig:
    values = dict(max_num_seqs=3, prefill_chunk_size=48, block_size=8, kv_cache_mb=4, max_queue=512)
    values.update(overrides)
    return EngineConfig(**values)


def keep_hidden(finished: list[FinishedSequence]) -> list[torch.Tensor]:
    return [f.hidden.clone() for f in finished]


def random_ids(vocab: int, length: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=gen)


class PausingFinish:
    """A finish callback that records the order of finished payloads and can hold the worker thread.

    ``hold()`` makes the next call block (the engine sits between two steps) until ``release()``;
    ``wait_held()`` returns once the worker is blocked there.
    """

    def __init__(self, inner: Callable[[list[FinishedSequence]], list] | None = None) -> None:
        self.inner = inner or (lambda fs: [f.payload for f in fs])
        self.order: list = []
        self._hold = threading.Event()
        self._held = threading.Event()
        self._go = threading.Event()

    def hold(self) -> None:
        self._go.clear()
        self._held.clear()
        self._hold.set()

    def wait_held(self, timeout: float = 10.0) -> None:
        assert self._held.wait(timeout), "the engine never reached finish"

    def release(self) -> None:
        self._hold.clear()
        self._go.set()

    def __call__(self, finished: list[FinishedSequence]) -> list:
        self.order.extend(f.payload for f in finished)
        if self._hold.is_set():
            self._held.set()
            assert self._go.wait(30.0), "test never released the engine"
        return self.inner(finished)


async def audits_concluded(backend: Any, count: int, timeout_s: float = 120) -> dict[str, Any]:
    """An engine backend's audit counters once ``count`` audits have concluded (match, mismatch or skipped),
    or at ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stats = backend.stats()["audit"]
        if stats["match"] + stats["mismatch"] + stats["skipped"] >= count or loop.time() > deadline:
            return stats
        await asyncio.sleep(0.02)

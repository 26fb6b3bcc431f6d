"""Matmul FLOPs of a backbone prefill and the machine's measured matmul peak, for utilisation figures."""

from __future__ import annotations

import time

import torch

from clefserve.model.config import BackboneConfig
from clefserve.model.ops.delta_rule import CHUNK


def prefill_flops(config: BackboneConfig, tokens: int) -> float:
    """Matmul FLOPs of one prefill of ``tokens`` (projections, attention, chunked delta rule; no lm_head)."""
    h, inter = config.hidden_size, config.intermediate_size
    per_token = 0.0
    for kind in config.layer_types:
        per_token += 3 * h * inter  # SwiGLU
        if kind == "full_attention":
            q = config.num_attention_heads * config.head_dim
            kv = config.num_key_value_heads * config.head_dim
            per_token += h * (2 * q + 2 * kv) + q * h
            per_token += 2 * q * (tokens + 1) / 2  # QK^T and AV over the causal context, averaged
        else:
            per_token += h * (config.conv_dim + config.linear_value_dim + 2 * config.linear_num_value_heads)
            per_token += config.linear_value_dim * h
            k, v = config.linear_key_head_dim, config.linear_value_head_dim
            chunk_work = 2 * CHUNK * k + CHUNK * (k + v) + CHUNK * v + 3 * k * v
            per_token += config.linear_num_value_heads * chunk_work
    return 2.0 * per_token * tokens


def matmul_peak(dtype: torch.dtype, sizes: tuple[int, ...] = (1024, 2048, 3072), trials: int = 3) -> float:
    """Best FLOP/s of large square matmuls in ``dtype`` on the current torch threads."""
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        a @ b
        for _ in range(trials):
            start = time.perf_counter()
            a @ b
            best = max(best, 2.0 * size**3 / (time.perf_counter() - start))
    return best

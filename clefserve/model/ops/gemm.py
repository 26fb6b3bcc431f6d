"""Projections ``x @ W^T`` and the precision this machine runs them in.

Two CPU facts shape this:

- GEMM libraries switch kernels for very small row counts, which changes the rounding of a row depending on
  what it was batched with. Calls with fewer than ``MIN_ROWS`` rows are padded to ``MIN_ROWS``, so a row's
  result is identical across chunkings and batch compositions (the engine's batch invariance rests on it).
- bf16/f16 GEMMs are fast only where oneDNN has kernels for them (AVX-512 or AMX CPUs); elsewhere (AVX2)
  torch falls back to a scalar loop that is 5-30x slower than fp32. There the weights stay in low precision
  (memory) and each projection runs in fp32 arithmetic on upcast copies, its result rounded back to the
  model dtype: the numerics of a low-precision GEMM with fp32 accumulation, at fp32 speed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MIN_ROWS = 16
LOW_PRECISION = (torch.bfloat16, torch.float16)


@functools.cache
def native_low_precision(dtype: torch.dtype) -> bool:
    """Whether this CPU has fast GEMM kernels for ``dtype`` (bf16 or f16)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype projections of ``dtype`` weights compute in on ``device``."""
    if device.type == "cpu" and dtype in LOW_PRECISION and not native_low_precision(dtype):
        return torch.float32
    return dtype


def describe(device: torch.device, dtype: torch.dtype) -> str:
    """One line for the startup log and the model card."""
    name = str(dtype).removeprefix("torch.")
    if compute_dtype(device, dtype) == dtype:
        return f"torch {name}"
    return f"torch fp32 arithmetic on {name} weights (this CPU has no fast {name} GEMM)"


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ weight[out, in]^T`` without bias, padded and upcast as the module docstring says."""
    on_cpu = x.device.type == "cpu"
    upcast = on_cpu and compute_dtype(x.device, weight.dtype) != weight.dtype
    rows = x.shape[0]
    pad = on_cpu and x.dim() == 2 and rows < MIN_ROWS
    if pad:
        x = torch.cat((x, x.new_zeros(MIN_ROWS - rows, x.shape[1])))
    out = F.linear(x.float(), weight.float()).to(weight.dtype) if upcast else F.linear(x, weight)
    return out[:rows] if pad else out

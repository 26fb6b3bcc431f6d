"""Projections ``x @ W^T`` and the precision this machine runs them in.

Three CPU facts shape this:

- GEMM libraries switch kernels for very small row counts, which changes the rounding of a row depending on
  what it was batched with. Calls with fewer than ``MIN_ROWS`` rows are padded to ``MIN_ROWS``, so a row's
  result is identical across chunkings and batch compositions (the engine's batch invariance rests on it).
- bf16/f16 GEMMs are fast only on CPUs with instructions for them (AVX512_BF16 or AMX for bf16,
  AVX512_FP16 or AMX-FP16 for f16). Elsewhere oneDNN emulates them (an AVX-512 Ice Lake: bf16 4.5x slower
  than fp32) or torch falls back to a scalar loop (AVX2: 5-30x slower). There the weights stay in low
  precision (memory) and each projection runs in fp32 arithmetic on upcast copies, its result rounded back
  to the model dtype: the numerics of a low-precision GEMM with fp32 accumulation, at fp32 speed.
  Widening a weight on every call costs 5-40% of the projection (most for few rows and wide weights), so
  the loader keeps fp32 copies of the layers' projection weights when they fit (:func:`widen_weights`);
  the products are the same bits either way.
- On that fp32 path a rounding to the model dtype is a pass over memory of its own, and SwiGLU's gate and up
  outputs are the widest activations of a layer. The MLP therefore computes in fp32 from its widened input to
  its output and rounds once (:func:`upcasts`; ``clefserve.model.layers.MLP``), as a fused SwiGLU kernel
  would. That skips four roundings the reference makes (gate, up, SiLU, product). Measured when it came in:
  the differential tests' largest |dp| against the reference stayed at 4.5-7.5e-3 in bf16 (4.5-6.9e-3
  before) and fell to 4.9-7.8e-4 in f16 (5.4-8.5e-4); a 3,000-token record's hidden rows moved no further
  from the fp32 model's (relative error 9.20e-3 against 9.31e-3).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 16
# fp32 copies of the projection weights may take at most this share of the memory free after loading
WIDEN_SHARE = 0.5
LOW_PRECISION = (torch.bfloat16, torch.float16)
# x86 instructions that make a low-precision GEMM faster than fp32 (the names of /proc/cpuinfo's flags)
X86_NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def x86_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The CPU's feature flags on x86 Linux; None where they cannot be read."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return None


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN runs ``dtype`` (bf16 or f16) GEMMs on this CPU at all."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


@functools.cache
def native_low_precision(dtype: torch.dtype) -> bool:
    """Whether this CPU has fast GEMM kernels for ``dtype``: oneDNN must support it and, on x86, the CPU
    must have instructions for it (oneDNN also "supports" bf16 on any AVX-512 CPU, by emulation)."""
    if dtype not in LOW_PRECISION:
        return True
    if not onednn_supports(dtype):
        return False
    flags = x86_cpu_flags()
    return flags is None or any(flag in flags for flag in X86_NATIVE_FLAGS[dtype])


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


def widened_bytes(modules: list[nn.Module]) -> int:
    """Bytes of fp32 copies of these modules' weights."""
    return sum(4 * module.weight.numel() for module in modules)


def widen_weights(modules: list[nn.Module]) -> None:
    """Replace each module's low-precision weight by an fp32 copy (exact: every bf16/f16 value is an fp32
    one). :func:`linear` computes a low-precision ``x`` against it in fp32 and rounds to ``x``'s dtype."""
    for module in modules:
        module.weight = nn.Parameter(module.weight.detach().float(), requires_grad=False)


def upcasts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` computes ``x @ weight^T`` in fp32 on widened operands and rounds the result to
    ``x``'s dtype: a CPU without fast GEMMs for the weights' dtype, or held fp32 copies of them."""
    return x.device.type == "cpu" and (
        x.dtype != weight.dtype or compute_dtype(x.device, weight.dtype) != weight.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ weight[out, in]^T`` without bias, padded and upcast as the module docstring says; the
    result has ``x``'s dtype."""
    on_cpu = x.device.type == "cpu"
    upcast = upcasts(x, weight)
    rows = x.shape[0]
    pad = on_cpu and x.dim() == 2 and rows < MIN_ROWS
    if pad:
        x = torch.cat((x, x.new_zeros(MIN_ROWS - rows, x.shape[1])))
    out = F.linear(x.float(), weight.float()).to(x.dtype) if upcast else F.linear(x, weight)
    return out[:rows] if pad else out

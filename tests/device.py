"""The device and dtype the device-aware tests run on: ``pytest --device cuda --dtype bf16`` (defaults: cpu,
f32), so the equivalence, chunk-invariance, batch-invariance, prefix-cache and differential tests run
unchanged on a GPU when one is at hand.

fp32 keeps each test's own tolerance; f16/bf16 runs widen it to the dtype's (:func:`tolerance`).
"""

from __future__ import annotations

import torch

from clefserve.config import DTYPES

_DEVICE = torch.device("cpu")
_DTYPE = torch.float32

# Absolute tolerance on values of order one (hidden rows, probabilities) for a low-precision run.
DTYPE_TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 5e-2}


def configure(device: str, dtype: str) -> None:
    global _DEVICE, _DTYPE
    _DEVICE = torch.device(device)
    _DTYPE = DTYPES[dtype]
    if _DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: no CUDA device is available")


def device() -> torch.device:
    return _DEVICE


def dtype() -> torch.dtype:
    return _DTYPE


def on_cpu() -> bool:
    return _DEVICE.type == "cpu"


def tolerance(fp32: float) -> float:
    """The test's fp32 tolerance, or the dtype's when the tests run in f16/bf16."""
    return max(fp32, DTYPE_TOLERANCE.get(_DTYPE, 0.0))


def limit(want: torch.Tensor, fp32: float) -> float:
    """The allowed max |got - want|: the test's fp32 tolerance, or in f16/bf16 the dtype's, relative to the
    size of the values (hidden rows after the final norm are a few units)."""
    if dtype() == torch.float32:
        return fp32
    return max(fp32, DTYPE_TOLERANCE[_DTYPE]) * max(1.0, want.float().abs().max().item())


def assert_close(got: torch.Tensor, want: torch.Tensor, fp32: float, what: str = "") -> None:
    diff = (got.float() - want.float().to(got.device)).abs().max().item()
    allowed = limit(want, fp32)
    assert diff <= allowed, f"{what} max |diff| {diff:.3g} > {allowed:.3g} ({_DTYPE}, {_DEVICE})"

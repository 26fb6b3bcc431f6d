"""Picks one implementation per op for the device and dtype at startup (``--kernels``).

- ``reference``: the plain torch ops (:func:`~clefserve.model.ops.interface.reference_ops`), the oracle;
  the switch for the day a fast kernel turns out wrong on some machine.
- ``auto`` (default) and ``fast``: the fastest implementation this device supports. The startup
  self-check compares what was picked against the reference on canary records before serving.

Projections are not in the table: :mod:`clefserve.model.ops.gemm` picks their arithmetic per machine.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from clefserve.model.ops import attention, gemm
from clefserve.model.ops.delta_rule_batched import chunk_gated_delta_rule_batched
from clefserve.model.ops.interface import Ops, reference_ops

log = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "fast", "reference")


def select_ops(device: torch.device, dtype: torch.dtype, mode: str = "auto") -> Ops:
    if mode not in KERNEL_MODES:
        raise ValueError(f"--kernels must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    ops = reference_ops()
    if mode != "reference":
        ops = replace(ops, name="torch-fast", gated_delta_rule=chunk_gated_delta_rule_batched)
        if device.type == "cpu":
            ops = replace(ops, causal_attention=attention.causal_attention_split_cpu)
    return ops


def describe(ops: Ops, device: torch.device, dtype: torch.dtype) -> str:
    kernels = ", ".join(f"{op}={impl}" for op, impl in ops.kernels().items())
    return f"kernels ({ops.name}): {kernels}; projections: {gemm.describe(device, dtype)}"

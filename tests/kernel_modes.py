"""The op tables the backbone tests run over: the torch reference and what ``--kernels auto`` picks for the
device (on a CUDA device: flash-linear-attention and fused attention when available)."""

from __future__ import annotations

from clefserve.model.backbone import Backbone
from clefserve.model.ops.select import select_ops

KERNEL_MODES = ("reference", "auto")


def use_kernels(model: Backbone, mode: str) -> Backbone:
    model.set_ops(select_ops(model.device, model.dtype, mode))
    return model

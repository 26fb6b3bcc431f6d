"""The op tables the backbone tests run over: the torch reference and the fast path picked for the device."""

from __future__ import annotations

from clefserve.model.backbone import Backbone
from clefserve.model.ops.select import select_ops

KERNEL_MODES = ("reference", "fast")


def use_kernels(model: Backbone, mode: str) -> Backbone:
    model.set_ops(select_ops(model.device, model.dtype, mode))
    return model

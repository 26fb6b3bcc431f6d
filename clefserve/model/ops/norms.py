"""RMS norms of the Qwen3.5 backbone (torch reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm that scales by ``1 + weight`` (weights stored centred on zero), computed in fp32."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Gated DeltaNet output norm: plain-weight RMSNorm of ``x``, then times SiLU(gate)."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    out = weight.to(dtype) * normed
    return (out * F.silu(gate.float())).to(dtype)

"""RMS norms of the Qwen3.5 backbone (torch reference).

Without autograd, the intermediates this function made itself are overwritten in place instead of
allocating new ones; the arithmetic, and so every bit of the result, is the same either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms_scaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, in fp32: a new tensor, never ``x`` itself."""
    xf = x.float()
    scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if xf is x or torch.is_grad_enabled():
        return xf * scale
    return xf.mul_(scale)  # the fp32 copy of a low-precision x


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm that scales by ``1 + weight`` (weights stored centred on zero), computed in fp32."""
    out = _rms_scaled(x, eps)
    factor = 1.0 + weight.float()
    out = out * factor if torch.is_grad_enabled() else out.mul_(factor)
    return out.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Gated DeltaNet output norm: plain-weight RMSNorm of ``x``, then times SiLU(gate)."""
    dtype = x.dtype
    normed = _rms_scaled(x, eps).to(dtype)
    if torch.is_grad_enabled():
        return (weight.to(dtype) * normed * F.silu(gate.float())).to(dtype)
    normed.mul_(weight.to(dtype))  # a fresh tensor: the fp32 result, or its low-precision copy
    gate_f = gate.float()
    silu = F.silu(gate_f, inplace=gate_f is not gate)
    return silu.mul_(normed).to(dtype)

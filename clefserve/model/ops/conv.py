"""Depthwise causal conv with carried state, SiLU activated (torch reference).

Layout is channel-last: ``x [T, C]``, ``weight [C, K]``, ``state [C, K-1]`` holding the last K-1 inputs
before ``x`` (zeros at the start of a sequence).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(silu(conv(x)) [T, C], new_state [C, K-1])``."""
    channels, kernel = weight.shape
    steps = x.shape[0]
    if state is None:
        state = x.new_zeros(channels, kernel - 1)
    window = torch.cat((state.to(x.dtype), x.t()), dim=1)  # [C, K-1+T]
    out = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1).to(x.dtype), groups=channels)[0]  # [C, T]
    new_state = window[:, window.shape[1] - (kernel - 1) :] if kernel > 1 else window[:, :0]
    return F.silu(out).t()[:steps], new_state.contiguous()

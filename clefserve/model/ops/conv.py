"""Depthwise causal conv with carried state, SiLU activated (torch reference).

Layout is channel-last: ``x [T, C]``, ``weight [C, K]``, ``state [K-1, C]`` holding the last K-1 inputs
before ``x`` (zeros at the start of a sequence).

Written as K shifted multiply-adds rather than ``F.conv1d``: the same arithmetic for every position
whatever the length of the call, so a sequence run in pieces gets bit-identical conv outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(silu(conv(x)) [T, C], new_state [K-1, C])``."""
    kernel = weight.shape[1]
    steps = x.shape[0]
    history = kernel - 1
    if state is None:
        state = x.new_zeros(history, x.shape[1])
    window = torch.cat((state.to(x.dtype), x))  # [K-1+T, C]
    taps = weight.to(x.dtype).t().contiguous()  # [K, C]: contiguous rows keep the multiply-adds vectorised
    out = window[0:steps] * taps[0]
    for tap in range(1, kernel):
        out.addcmul_(window[tap : tap + steps], taps[tap])
    return F.silu(out), window[window.shape[0] - history :].clone()

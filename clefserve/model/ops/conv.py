"""Depthwise causal conv with carried state, SiLU activated (torch reference).

Layout is channel-last: ``x [T, C]``, ``weight [C, K]``, ``state [K-1, C]`` holding the last K-1 inputs
before ``x`` (zeros at the start of a sequence).

Written as K shifted multiply-adds rather than ``F.conv1d``: the same arithmetic for every position
whatever the length of the call, so a sequence run in pieces gets bit-identical conv outputs.

The taps are summed in fp32 and the sum is rounded to the input dtype once, before the SiLU: what the
reference's ``nn.Conv1d`` (oneDNN on a CPU) and fla's Triton kernel do. Summing in bf16 would round after
every tap: a third of the outputs one bf16 unit off the reference's, on random inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(silu(conv(x)) [T, C], new_state [K-1, C])``, both in x's dtype."""
    kernel = weight.shape[1]
    steps, channels = x.shape
    history = kernel - 1
    if state is None:
        state = x.new_zeros(history, channels)
    parts = (state.to(x.dtype), x)
    if torch.is_grad_enabled() and (x.requires_grad or state.requires_grad):
        window = torch.cat(parts).float()  # out= forms record no gradient (the demo's training script)
    else:
        window = x.new_empty(history + steps, channels, dtype=torch.float32)  # [K-1+T, C]
        torch.cat(parts, out=window)  # exact: every input dtype widens to fp32
    taps = weight.float().t().contiguous()  # [K, C]: contiguous rows keep the multiply-adds vectorised
    out = window[0:steps] * taps[0]
    for tap in range(1, kernel):
        out.addcmul_(window[tap : tap + steps], taps[tap])
    new_state = window[window.shape[0] - history :].to(x.dtype, copy=True)
    return F.silu(out.to(x.dtype)), new_state

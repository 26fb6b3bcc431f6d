"""Causal grouped-query attention of new tokens over all positions of their sequence (torch reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """``q [T, Hq, D]`` at positions past .. past+T-1; ``k, v [past+T, Hkv, D]``; returns ``[T, Hq, D]``."""
    steps, total = q.shape[0], k.shape[0]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if past == 0 and total == steps:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        rows = torch.arange(steps, device=q.device)[:, None] + past
        cols = torch.arange(total, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=cols <= rows, enable_gqa=gqa)
    return out[0].transpose(0, 1)

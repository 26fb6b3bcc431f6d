"""Causal attention of new tokens over their sequence's K/V.

``q [T, Hq, D]`` holds positions ``past .. past+T-1``; ``k, v [past+T, Hkv, D]`` every position of the
sequence (``Hq`` a multiple of ``Hkv``); the result is ``[T, Hq, D]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """The torch reference: SDPA with an explicit mask once there is history."""
    steps, total = q.shape[0], k.shape[0]
    qh, kh, vh = (_heads_first(x) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if past == 0 and total == steps:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        rows = torch.arange(steps, device=q.device)[:, None] + past
        cols = torch.arange(total, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=cols <= rows, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def causal_attention_split_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """CPU fast path without a materialised mask: the history (every key before ``past``, no mask) and the
    new block (causal, square) run as two fused flash-attention calls whose partial results are merged
    by their log-sum-exp. A masked call builds and reads a ``[T, past+T]`` mask and cannot skip the masked
    half of the new block."""
    if past == 0:
        return causal_attention(q, k, v, past)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qh = _heads_first(q)
    out_past, lse_past = flash(qh, _heads_first(k[:past]), _heads_first(v[:past]), 0.0, False)
    out_new, lse_new = flash(qh, _heads_first(k[past:]), _heads_first(v[past:]), 0.0, True)
    top = torch.maximum(lse_past, lse_new)
    w_past, w_new = (lse_past - top).exp_(), (lse_new - top).exp_()
    total = w_past + w_new
    merged = out_past.float() * (w_past / total)[..., None] + out_new.float() * (w_new / total)[..., None]
    return merged.to(q.dtype)[0].transpose(0, 1)

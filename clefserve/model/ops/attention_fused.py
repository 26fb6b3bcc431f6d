"""Causal attention over a sequence's paged K/V through SDPA's fused CUDA kernels, never a materialised mask.

Same signature as :func:`clefserve.model.ops.attention.causal_attention`: ``q [T, Hq, D]`` at positions
``past .. past+T-1`` over ``k, v [past+T, Hkv, D]``.

- :func:`causal_attention_flash`: one flash-attention call. Flash's causal mask for a query block shorter
  than the keys is aligned to the bottom right (query ``t`` sees keys ``<= past + t``), which is exactly a
  continued sequence; grouped K/V heads are read natively. Ampere (sm80) and later, f16/bf16 only.
- :func:`causal_attention_split`: any CUDA GPU and dtype (memory-efficient attention). The history (keys
  before ``past``, no mask) and the new square block (causal) are two fused calls whose results are merged by
  their log-sum-exp. For the history the query heads that share a K/V head are folded into the rows, so the
  history's K/V is read once per K/V head and never repeated; only the new block's K/V (T rows) is repeated.

Both start with plain SDPA (``is_causal=True``) for a sequence's first tokens. The fused op is chosen by
:func:`lse_kernel`; on a CPU tensor it is the CPU flash kernel, which is how the CPU tests check the fold
and the merge.
"""

from __future__ import annotations

import torch

from clefserve.model.ops.attention import causal_attention


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]


def lse_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention of ``q [1, H, L, D]`` over ``k, v [1, H, S, D]`` returning ``(out, lse [1, H, L])``;
    ``causal`` masks a square block (upper left)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse
    out, lse, _seed, _offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal)
    return out, lse[..., : q.shape[2]]  # the kernel pads the rows of its log-sum-exp to a multiple of 32


def causal_attention_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    if past == 0:
        return causal_attention(q, k, v, past)
    steps, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    folded = q.view(steps, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * steps, dim)
    out_past, lse_past = lse_kernel(folded, _heads_first(k[:past]), _heads_first(v[:past]), False)
    out_past = out_past.reshape(1, heads, steps, dim)
    lse_past = lse_past.reshape(1, heads, steps)
    k_new, v_new = _heads_first(k[past:]), _heads_first(v[past:])
    if group > 1:
        k_new, v_new = k_new.repeat_interleave(group, dim=1), v_new.repeat_interleave(group, dim=1)
    out_new, lse_new = lse_kernel(_heads_first(q), k_new, v_new, True)
    top = torch.maximum(lse_past, lse_new)
    w_past, w_new = (lse_past - top).exp(), (lse_new - top).exp()
    total = w_past + w_new
    merged = out_past.float() * (w_past / total)[..., None] + out_new.float() * (w_new / total)[..., None]
    return merged.to(q.dtype)[0].transpose(0, 1)


def causal_attention_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    if past == 0:
        return causal_attention(q, k, v, past)
    qh, kh, vh = _heads_first(q), _heads_first(k), _heads_first(v)
    # is_causal=True on a query block shorter than the keys: bottom-right aligned for this op
    out = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, True)[0]
    return out[0].transpose(0, 1)


"""flash-linear-attention's Triton kernels behind our op signatures (the CUDA fast path).

Imported only by :mod:`clefserve.model.ops.select`, and only for a CUDA device or under Triton's
interpreter (:mod:`clefserve.model.ops.triton_interpreter`): importing fla where Triton has no driver makes
transformers route its own CPU Qwen3.5 forward into fla, which then fails.

- :func:`gated_delta_rule`: the step's sequences as one varlen call (``cu_seqlens``), each from its slot's
  fp32 state, with q/k L2-normalised inside the kernel; gates (``g``, ``beta``) are handed over in fp32.
  fla chunks every sequence from its first new token (our reference aligns chunks to absolute positions),
  so a sequence run in pieces agrees with a one-piece run to rounding, not bit for bit. Decode steps (one
  token per sequence) take the chunk kernel too: fla's ``fused_recurrent_gated_delta_rule`` returned wrong
  values under Triton's interpreter with varlen inputs, and has not been checked on a GPU yet.
- :func:`causal_conv1d`: fla's Triton causal conv for one sequence; its state layout is ``[C, K]`` (the last
  K inputs), ours ``[K-1, C]`` (the last K-1).
"""

from __future__ import annotations

import torch
from fla.modules.causal_conv1d import causal_conv1d as _fla_causal_conv1d
from fla.ops.gated_delta_rule import chunk_gated_delta_rule


def _cu_seqlens(seq_lens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    bounds = [0]
    for n in seq_lens:
        bounds.append(bounds[-1] + n)
    on_host = torch.tensor(bounds, dtype=torch.long)
    return on_host.to(device, non_blocking=True), on_host


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor,
    seq_lens: tuple[int, ...],
    past_lens: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The signature of :func:`clefserve.model.ops.delta_rule.gated_delta_rule_varlen`."""
    del past_lens  # fla needs no absolute positions: the state carries the history
    cu, cu_host = _cu_seqlens(seq_lens, q.device)
    dtype = v.dtype
    args = (q.to(dtype)[None], k.to(dtype)[None], v[None], g.float()[None], beta.float()[None])
    state = initial.float().contiguous()
    out, final = chunk_gated_delta_rule(
        *args, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu, cu_seqlens_cpu=cu_host)
    return out[0].to(dtype), final.float()


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The signature of :func:`clefserve.model.ops.conv.causal_conv1d`: ``(silu(conv(x)) [T, C],
    new_state [K-1, C])``."""
    channels, kernel = weight.shape
    initial = None
    if state is not None:
        initial = x.new_zeros(1, channels, kernel)
        initial[0, :, 1:] = state.to(x.dtype).t()
    out, final = _fla_causal_conv1d(x[None], weight.to(x.dtype).contiguous(), initial_state=initial,
                                    output_final_state=True, activation="silu")
    return out[0], final[0, :, 1:].t().contiguous()

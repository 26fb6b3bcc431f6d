"""The layers of the Qwen3.5 hybrid backbone. Parameter names follow the checkpoint's.

Every layer works on the flat ``[N, hidden]`` rows of one forward step, which may hold the new tokens of
several sequences side by side (``Batch``); token mixers treat each sequence on its own, everything else
runs over all rows at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from clefserve.model.cache import ForwardCache
from clefserve.model.config import BackboneConfig
from clefserve.model.ops import Ops, gemm


@dataclass(frozen=True)
class Batch:
    """Where each sequence's new tokens sit in the flat rows, and how many tokens it had before.

    ``mrope``: per sequence, the M-RoPE positions ``[3, n]`` of its new tokens (a record with pictures),
    or None where the positions are the token indexes; None for the whole batch when all are text.
    ``captures``: per sequence, 0 or a count ``0 < d < n`` of its new tokens after which the Gated DeltaNet
    layers hand their state to ``cache.keep_linear_states`` (a prefix-cache snapshot inside a step); empty
    when no sequence asks.
    """

    seq_lens: tuple[int, ...]
    past_lens: tuple[int, ...]
    mrope: tuple[torch.Tensor | None, ...] | None = None
    captures: tuple[int, ...] = ()

    def spans(self) -> list[tuple[int, int, int]]:
        """``(seq, start_row, end_row)`` per sequence."""
        out, start = [], 0
        for i, n in enumerate(self.seq_lens):
            out.append((i, start, start + n))
            start += n
        return out

    def positions(self, device: torch.device) -> torch.Tensor:
        return torch.cat(
            [
                torch.arange(p, p + n, device=device)
                for n, p in zip(self.seq_lens, self.past_lens, strict=True)
            ]
        )


def _step_rows(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The per-sequence results of a step's sequences as the step's rows: a lone sequence's as it is (no
    copy), several joined."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class Embedding(nn.Embedding):
    """Skips its random init on the meta device (how loaders build a model before assigning weights):
    ``normal_`` there imports torch._dynamo, over a second of every start."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Linear(nn.Linear):
    """A bias-free projection through :func:`clefserve.model.ops.gemm.linear`: a row's result does not
    depend on how many rows share the call, and low-precision weights compute in fp32 on CPUs without fast
    low-precision GEMMs."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.linear(x, self.weight)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (scales by 1 + weight)."""

    def __init__(self, dim: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet output norm: plain weight, SiLU gate."""

    def __init__(self, dim: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.ops.gated_rms_norm(x, gate, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU feed-forward. Where projections compute in fp32 on widened operands
    (:func:`clefserve.model.ops.gemm.upcasts`), the whole block does, rounding once at its output: the
    intermediate roundings would each be a pass over the layer's widest activations (see that module)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inside = x.float() if gemm.upcasts(x, self.gate_proj.weight) else x
        if torch.is_grad_enabled():
            hidden = F.silu(self.gate_proj(inside)) * self.up_proj(inside)
        else:
            hidden = F.silu(self.gate_proj(inside), inplace=True).mul_(self.up_proj(inside))
        return self.down_proj(hidden).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention with an output gate (q_proj gives [query | gate] per head), q/k norms, partial RoPE."""

    def __init__(self, config: BackboneConfig, layer: int, ops: Ops) -> None:
        super().__init__()
        self.layer, self.ops = layer, ops
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.heads * self.head_dim * 2)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim)
        self.o_proj = Linear(self.heads * self.head_dim, hidden)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)

    def forward(
        self, x: torch.Tensor, batch: Batch, rope: tuple[torch.Tensor, torch.Tensor], cache: ForwardCache
    ) -> torch.Tensor:
        rows = x.shape[0]
        query, gate = self.q_proj(x).view(rows, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        query = self.q_norm(query)
        key = self.k_norm(self.k_proj(x).view(rows, self.kv_heads, self.head_dim))
        value = self.v_proj(x).view(rows, self.kv_heads, self.head_dim)
        cos, sin = rope
        query, key = self.ops.apply_rope(query, cos, sin), self.ops.apply_rope(key, cos, sin)
        pieces = []
        for seq, start, end in batch.spans():
            all_k, all_v = cache.attention_kv(self.layer, seq, key[start:end], value[start:end])
            pieces.append(self.ops.causal_attention(query[start:end], all_k, all_v, batch.past_lens[seq]))
        out = _step_rows(pieces)
        gate = torch.sigmoid(gate.reshape(rows, -1))
        out = out.reshape(rows, -1) * gate if torch.is_grad_enabled() else out.reshape(rows, -1).mul_(gate)
        return self.o_proj(out)


class DepthwiseConv(nn.Module):
    """Holds the depthwise causal conv weight ``[channels, 1, kernel]`` under the checkpoint's name."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    """Linear-attention token mixer: causal conv over [q|k|v], then the gated delta rule per value head."""

    def __init__(self, config: BackboneConfig, layer: int, ops: Ops) -> None:
        super().__init__()
        self.layer, self.ops = layer, ops
        self.k_heads, self.v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_width, self.value_width = config.linear_key_dim, config.linear_value_dim
        hidden = config.hidden_size
        self.in_proj_qkv = Linear(hidden, config.conv_dim)
        self.in_proj_z = Linear(hidden, self.value_width)
        self.in_proj_b = Linear(hidden, self.v_heads)
        self.in_proj_a = Linear(hidden, self.v_heads)
        self.conv1d = DepthwiseConv(config.conv_dim, config.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps, ops)
        self.out_proj = Linear(self.value_width, hidden)

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta = sigmoid(b) and decay g = -exp(A_log) * softplus(a + dt_bias), in fp32 (exp(A_log) can
        overflow fp16). Rows are padded to a multiple of 16: the CPU's vectorised exp/log differ in the
        last bit from the scalar tail loop, which would make an element's value depend on the batch."""
        rows = b.shape[0]
        pad = (-rows) % 16
        if pad:
            b, a = F.pad(b, (0, 0, 0, pad)), F.pad(a, (0, 0, 0, pad))
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return beta[:rows], g[:rows]

    def _delta_rule_split(
        self, inputs: tuple[torch.Tensor, ...], initial: torch.Tensor, batch: Batch, splits: dict[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """The delta rule with each sequence of ``splits`` run in two parts, its first ``splits[seq]`` new
        tokens and then the rest from the state between them: the arithmetic of two steps cut there, so a
        later sequence resumed from that state computes what this one does. Returns the output rows, the
        final states and the states at the splits."""
        spans, device = batch.spans(), inputs[0].device
        heads = [seq for seq, _, _ in spans if seq in splits]
        first = torch.cat([torch.arange(start, start + splits[seq], device=device)
                           for seq, start, _ in spans if seq in splits])
        rest = torch.cat([torch.arange(start + splits.get(seq, 0), end, device=device)
                          for seq, start, end in spans])
        head_out, at_split = self.ops.gated_delta_rule(
            *(x.index_select(0, first) for x in inputs), initial[heads],
            tuple(splits[seq] for seq in heads), tuple(batch.past_lens[seq] for seq in heads))
        initial = initial.index_copy(0, torch.tensor(heads, device=device), at_split)
        rest_out, final = self.ops.gated_delta_rule(
            *(x.index_select(0, rest) for x in inputs), initial,
            tuple(n - splits.get(seq, 0) for seq, n in enumerate(batch.seq_lens)),
            tuple(p + splits.get(seq, 0) for seq, p in enumerate(batch.past_lens)))
        out = rest_out.new_empty(inputs[0].shape[0], *rest_out.shape[1:])
        out.index_copy_(0, first, head_out)
        out.index_copy_(0, rest, rest_out)
        return out, final, dict(zip(heads, at_split, strict=True))

    def forward(self, x: torch.Tensor, batch: Batch, cache: ForwardCache) -> torch.Tensor:
        rows = x.shape[0]
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        beta, g = self._gates(self.in_proj_b(x), self.in_proj_a(x))
        weight = self.conv1d.weight[:, 0, :]
        conv_states, recurrent_states = cache.linear_states(self.layer)
        starts = [past == 0 for past in batch.past_lens]  # a sequence's first tokens start from zeros
        fresh = x.new_zeros(self.v_heads, self.k_dim, self.v_dim, dtype=torch.float32)
        recurrent = torch.stack([fresh if new or r is None else r
                                 for new, r in zip(starts, recurrent_states, strict=True)])
        pieces, new_conv_states = [], []
        for seq, start, end in batch.spans():
            carried = None if starts[seq] else conv_states[seq]
            piece, state = self.ops.causal_conv1d(mixed[start:end], weight, carried)
            pieces.append(piece)
            new_conv_states.append(state)
        qkv = _step_rows(pieces)
        q, k, v = torch.split(qkv, [self.key_width, self.key_width, self.value_width], dim=-1)
        inputs = (q.reshape(rows, self.k_heads, self.k_dim), k.reshape(rows, self.k_heads, self.k_dim),
                  v.reshape(rows, self.v_heads, self.v_dim), g, beta)
        splits = {seq: d for seq, d in enumerate(batch.captures) if 0 < d < batch.seq_lens[seq]}
        if splits:
            keeping = getattr(self.ops.gated_delta_rule, "keeping", None)
            if keeping is not None:  # the op keeps the states inside the pieces itself
                keep = tuple(splits.get(seq, 0) for seq in range(len(batch.seq_lens)))
                core, recurrent, inside = keeping(*inputs, recurrent, batch.seq_lens, batch.past_lens, keep)
                kept = dict(zip(sorted(splits), inside, strict=True))
            else:
                core, recurrent, kept = self._delta_rule_split(inputs, recurrent, batch, splits)
            history = weight.shape[1] - 1
            for (seq, start, _), carried in zip(batch.spans(), conv_states, strict=True):
                if seq in splits:  # the conv state is the last kernel-1 inputs before the split
                    d = splits[seq]
                    before = mixed.new_zeros(history, mixed.shape[1]) if carried is None or starts[seq] \
                        else carried.to(mixed.dtype)
                    conv = torch.cat((before, mixed[start : start + d]))[d:]
                    cache.keep_linear_states(self.layer, seq, conv, kept[seq])
        else:
            core, recurrent = self.ops.gated_delta_rule(*inputs, recurrent, batch.seq_lens, batch.past_lens)
        cache.store_linear_states(self.layer, new_conv_states, recurrent)
        normed = self.norm(core, z.view(rows, self.v_heads, self.v_dim))
        return self.out_proj(normed.reshape(rows, self.value_width))


class DecoderLayer(nn.Module):
    def __init__(self, config: BackboneConfig, layer: int, ops: Ops) -> None:
        super().__init__()
        self.kind = config.layer_types[layer]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer, ops)
        else:
            self.self_attn = GatedAttention(config, layer, ops)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        x: torch.Tensor,
        batch: Batch,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: ForwardCache,
        boundary: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """``boundary``: called between the token mixer and the MLP (see ``Backbone.forward``)."""
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h = self.linear_attn(h, batch, cache)
        else:
            h = self.self_attn(h, batch, rope, cache)
        # without autograd, h and the MLP's output are this layer's own tensors: add into them
        x = x + h if torch.is_grad_enabled() else h.add_(x)
        if boundary is not None:
            boundary()
        if torch.is_grad_enabled():
            return x + self.mlp(self.post_attention_layernorm(x))
        return self.mlp(self.post_attention_layernorm(x)).add_(x)

"""The chunked gated delta rule over every sequence of a step at once (torch fallback on a GPU without fla).

Same arithmetic as :func:`clefserve.model.ops.delta_rule.chunk_gated_delta_rule` (chunks aligned to absolute
positions, UT transform inside a chunk), arranged so that few, large batched matmuls do the work:

- every chunk of every sequence goes through the intra-chunk algebra in one batch;
- the scan over chunks advances all sequences together: step ``j`` updates the state of every sequence that
  has a ``j``-th chunk (sequences sorted by chunk count, so those are a leading slice);
- the scan only carries the state; each chunk's output, which needs the state before the chunk, is computed
  after the scan in one batched matmul over all chunks.

Layouts: chunk-major ``[chunks, HV, C, d]``, chunks in scan order (all sequences' first chunks, then the
second chunks of those that have one, ...), so each scan step reads contiguous slices.

On a GPU this turns one launch per chunk per sequence into one per chunk step. On a CPU it pays only where
the step's work is many small pieces with small heads (the cost is then the number of ops, ~75 per piece);
with large heads or long pieces the per-sequence form's matmuls are already large and it is faster.
:func:`gated_delta_rule_cpu` chooses between the two per step.
"""

from __future__ import annotations

import torch

from clefserve.model.ops.delta_rule import (
    CHUNK,
    RECURRENT_MAX,
    decay_factors,
    gated_delta_rule_varlen,
    gated_delta_rule_varlen_keeping,
    solve_unit_lower,
)

# Where the step-batched form beat the per-sequence one on a 2-core CPU (fp32, 2 threads; min of 10-30 runs):
# 1.2-2.6x for 2-12 pieces of 20-300 tokens with 16-wide heads and of 20-160 with 32-wide ones; 0.65-0.95x
# for 32-wide heads over 200-300-token pieces and for 128-wide heads. Per piece, the work grows with its
# tokens x key dim x value dim, the saving is a fixed ~75 ops: it pays while the mean piece's work is small.
SMALL_WORK = 160 * 32 * 32  # mean tokens per piece x key dim x value dim


def _normalised(q: torch.Tensor, k: torch.Tensor, heads_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    repeat = heads_v // q.shape[1]
    if repeat > 1:
        q = q.repeat_interleave(repeat, dim=1)
        k = k.repeat_interleave(repeat, dim=1)
    return q * q.shape[-1] ** -0.5, k


class _Plan:
    """Where each token and each chunk of the step goes in the scan-ordered chunk layout."""

    def __init__(self, seq_lens: tuple[int, ...], past_lens: tuple[int, ...], chunk: int,
                 device: torch.device) -> None:
        fronts = [p % chunk for p in past_lens]
        counts = [-(-(f + n) // chunk) for f, n in zip(fronts, seq_lens, strict=True)]
        self.order = sorted(range(len(seq_lens)), key=lambda i: -counts[i])  # stable: ties keep batch order
        self.steps = counts[self.order[0]] if counts else 0
        self.active = [sum(1 for c in counts if c > j) for j in range(self.steps)]
        self.offsets = [0]
        for m in self.active:
            self.offsets.append(self.offsets[-1] + m)
        self.num_chunks = self.offsets[-1]
        starts = [0]
        for n in seq_lens[:-1]:
            starts.append(starts[-1] + n)
        dest = torch.empty(sum(seq_lens), dtype=torch.long)
        offsets = torch.tensor(self.offsets[:-1], dtype=torch.long)
        for rank, i in enumerate(self.order):
            local = torch.arange(fronts[i], fronts[i] + seq_lens[i])  # position in the padded sequence
            rows = (offsets[local // chunk] + rank) * chunk + local % chunk
            dest[starts[i] : starts[i] + seq_lens[i]] = rows
        self.dest = dest.to(device)  # padded row of every token of the step


def chunk_gated_delta_rule_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor,
    seq_lens: tuple[int, ...],
    past_lens: tuple[int, ...],
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The signature of :func:`clefserve.model.ops.delta_rule.gated_delta_rule_varlen`."""
    out_dtype = v.dtype
    heads_v, key_dim, value_dim = v.shape[1], q.shape[-1], v.shape[-1]
    plan = _Plan(seq_lens, past_lens, chunk, q.device)
    n, padded_rows = plan.num_chunks, plan.num_chunks * chunk
    q, k = _normalised(q, k, heads_v)

    def padded(x: torch.Tensor) -> torch.Tensor:
        """Token rows ``[N, HV, ...]`` into zero-padded chunks ``[n, HV, C, ...]`` in scan order."""
        out = x.new_zeros(padded_rows, *x.shape[1:])
        out.index_copy_(0, plan.dest, x)
        out = out.view(n, chunk, *x.shape[1:]).transpose(1, 2)
        return out.contiguous()

    qc, kc, vc = padded(q), padded(k), padded(v.float())
    gc = padded(g.float()).cumsum(-1)  # [n, HV, C]: cumulative log decay inside each chunk
    bc = padded(beta.float())[..., None]
    pair_decay = decay_factors(gc[..., :, None] - gc[..., None, :], scratch=True).tril()

    k_beta = kc * bc
    system = ((k_beta @ kc.transpose(-1, -2)) * pair_decay).tril(-1)
    gexp = decay_factors(gc)
    rhs = torch.cat((vc * bc, k_beta * gexp[..., None]), dim=-1)
    solved = solve_unit_lower(system, rhs, overwrite=True)
    values, key_decay = solved[..., :value_dim], solved[..., value_dim:]
    intra = (qc @ kc.transpose(-1, -2)) * pair_decay
    q_decayed = qc * gexp[..., None]
    last = gc[..., -1:]
    k_to_end = (kc * decay_factors(last - gc, scratch=True)[..., None]).transpose(-1, -2).contiguous()
    chunk_decay = decay_factors(last)[..., None]  # [n, HV, 1, 1]

    before = initial.new_empty(n, heads_v, key_dim, value_dim, dtype=torch.float32)  # state before a chunk
    v_new = torch.empty_like(vc)
    final = torch.empty_like(before[: len(seq_lens)])
    if plan.steps:
        before[: plan.active[0]] = initial.float()[plan.order]
    for j, m in enumerate(plan.active):
        lo, hi = plan.offsets[j], plan.offsets[j + 1]
        state = before[lo:hi].view(m * heads_v, key_dim, value_dim)
        fresh = torch.baddbmm(values[lo:hi].view(m * heads_v, chunk, value_dim),
                              key_decay[lo:hi].view(m * heads_v, chunk, key_dim), state, alpha=-1)
        v_new[lo:hi] = fresh.view(m, heads_v, chunk, value_dim)
        state = torch.baddbmm((before[lo:hi] * chunk_decay[lo:hi]).view(m * heads_v, key_dim, value_dim),
                              k_to_end[lo:hi].view(m * heads_v, key_dim, chunk), fresh)
        state = state.view(m, heads_v, key_dim, value_dim)
        going_on = plan.active[j + 1] if j + 1 < plan.steps else 0
        if going_on:
            before[hi : hi + going_on] = state[:going_on]
        final[going_on:m] = state[going_on:]  # ranks that end with this chunk
    out = q_decayed @ before + intra @ v_new  # [n, HV, C, V]
    out = out.transpose(1, 2).reshape(padded_rows, heads_v, value_dim).index_select(0, plan.dest)
    by_batch = torch.empty_like(final)
    by_batch[plan.order] = final
    return out.to(out_dtype), by_batch


def gated_delta_rule_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor,
    seq_lens: tuple[int, ...],
    past_lens: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU's choice per step: the step-batched form for several pieces of little work each, else one
    call per sequence. A step with a piece short enough for the recurrent form goes per sequence, so a
    sequence's numbers never depend on its neighbours (both chunked forms do the same arithmetic)."""
    many_small = (
        len(seq_lens) >= 2
        and sum(seq_lens) * k.shape[-1] * v.shape[-1] <= SMALL_WORK * len(seq_lens)
        and min(seq_lens) > RECURRENT_MAX
    )
    if many_small:
        return chunk_gated_delta_rule_batched(q, k, v, g, beta, initial, seq_lens, past_lens)
    return gated_delta_rule_varlen(q, k, v, g, beta, initial, seq_lens, past_lens)


# a step with a prefix-cache snapshot inside a piece goes per sequence, keeping the state there
gated_delta_rule_cpu.keeping = gated_delta_rule_varlen_keeping  # type: ignore[attr-defined]

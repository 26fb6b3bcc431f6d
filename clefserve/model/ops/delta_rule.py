"""The gated delta rule of Gated DeltaNet (torch reference), for one sequence.

Per value head, with recurrent state ``S [K, V]`` (fp32) and decay ``g <= 0`` in log space::

    S <- exp(g_t) * S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t

q and k are L2-normalised (eps 1e-6) and q is scaled by 1/sqrt(K) inside. When there are more value heads
than key heads, value head ``j`` reads key head ``j // (HV / H)``.

Shapes: ``q, k [T, H, K]``, ``v [T, HV, V]``, ``g, beta [T, HV]``, ``state [HV, K, V]`` or None.
Both forms return ``(o [T, HV, V] in v's dtype, new_state [HV, K, V] fp32)``.
"""

from __future__ import annotations

import torch

CHUNK = 64


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 for fp32 models on the CPU, else fp32. The stored state is fp32 either way.

    The gated output norm divides by the RMS of the delta-rule output, which is often small, so rounding
    inside the recurrence is amplified; fp64 keeps an fp32 model's answers independent of how a sequence
    was split into chunks or batched (to ~1e-6) for about 20% more delta-rule time on the CPU.
    """
    return torch.float64 if x.dtype == torch.float32 and x.device.type == "cpu" else torch.float32


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, ...]:
    heads_v = v.shape[1]
    q, k = q.to(acc), k.to(acc)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    repeat = heads_v // q.shape[1]
    if repeat > 1:
        q = q.repeat_interleave(repeat, dim=1)
        k = k.repeat_interleave(repeat, dim=1)
    q = q * q.shape[-1] ** -0.5
    # head-major [HV, T, d]
    return q.transpose(0, 1), k.transpose(0, 1), v.to(acc).transpose(0, 1)


def _initial_state(
    state: torch.Tensor | None, q: torch.Tensor, v: torch.Tensor, acc: torch.dtype
) -> torch.Tensor:
    if state is None:
        return q.new_zeros(v.shape[1], q.shape[-1], v.shape[-1], dtype=acc)
    return state.to(acc)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form; cheapest for a handful of tokens (decode steps)."""
    out_dtype = v.dtype
    acc = accumulation_dtype(v)
    s = _initial_state(state, q, v, acc).clone()
    qh, kh, vh = _prepare(q, k, v, acc)
    decay = g.to(acc).t().exp()  # [HV, T]
    beta = beta.to(acc).t()
    out = torch.empty_like(vh)
    for t in range(qh.shape[1]):
        s.mul_(decay[:, t, None, None])
        k_t = kh[:, t]  # [HV, K]
        memory = torch.einsum("hkv,hk->hv", s, k_t)
        delta = (vh[:, t] - memory) * beta[:, t, None]
        s.add_(k_t[:, :, None] * delta[:, None, :])
        out[:, t] = torch.einsum("hkv,hk->hv", s, qh[:, t])
    return out.transpose(0, 1).to(out_dtype), s.float()


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    past: int = 0,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (UT-transform) form: the intra-chunk work is batched matmuls, only chunks are scanned.

    Chunks are aligned to absolute positions (multiples of ``chunk`` counted from the sequence start, with
    ``past`` tokens already consumed), so a sequence run in pieces groups its arithmetic like a one-piece
    run: only the chunk that a piece boundary cuts is computed differently. Zero rows pad both ends; with
    k = 0 and beta = 0 they neither read nor change the state.
    """
    out_dtype = v.dtype
    steps = q.shape[0]
    acc = accumulation_dtype(v)
    s = _initial_state(state, q, v, acc)
    qh, kh, vh = _prepare(q, k, v, acc)
    g = g.to(acc).t()  # [HV, T]
    beta = beta.to(acc).t()
    front = past % chunk
    back = (-(front + steps)) % chunk
    if front or back:
        qh, kh, vh = (torch.nn.functional.pad(x, (0, 0, front, back)) for x in (qh, kh, vh))
        g, beta = (torch.nn.functional.pad(x, (front, back)) for x in (g, beta))
    heads = qh.shape[0]
    n = qh.shape[1] // chunk
    qc, kc, vc = (x.reshape(heads, n, chunk, -1) for x in (qh, kh, vh))
    gc = g.reshape(heads, n, chunk).cumsum(-1)  # cumulative log decay inside each chunk
    bc = beta.reshape(heads, n, chunk, 1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pair_decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()

    k_beta = kc * bc
    system = (k_beta @ kc.transpose(-1, -2)) * pair_decay
    system = system.tril(-1) + torch.eye(chunk, dtype=system.dtype, device=system.device)
    rhs = torch.cat((vc * bc, k_beta * gc.exp()[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values, key_decay = solved[..., : vc.shape[-1]], solved[..., vc.shape[-1] :]

    intra = (qc @ kc.transpose(-1, -2)) * pair_decay
    q_decayed = qc * gc.exp()[..., None]
    last = gc[..., -1:]
    k_to_end = kc * (last - gc).exp()[..., None]
    chunk_decay = last.exp()[..., None]  # [HV, n, 1, 1]

    out = torch.empty_like(vc)
    for i in range(n):
        v_new = values[:, i] - key_decay[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, n * chunk, -1)[:, front : front + steps]
    return out.transpose(0, 1).to(out_dtype), s.float()


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    past: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Picks the recurrent form for a few tokens and the chunked form for many."""
    if q.shape[0] <= 4:
        return recurrent_gated_delta_rule(q, k, v, g, beta, state)
    return chunk_gated_delta_rule(q, k, v, g, beta, state, past)

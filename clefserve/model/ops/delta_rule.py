"""The gated delta rule of Gated DeltaNet (torch reference), for one sequence.

Per value head, with recurrent state ``S [K, V]`` (fp32) and decay ``g <= 0`` in log space::

    S <- exp(g_t) * S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t

q and k are L2-normalised (eps 1e-6) and q is scaled by 1/sqrt(K) inside. When there are more value heads
than key heads, value head ``j`` reads key head ``j // (HV / H)``. All arithmetic is fp32.

Shapes: ``q, k [T, H, K]``, ``v [T, HV, V]``, ``g, beta [T, HV]``, ``state [HV, K, V]`` or None.
Both forms return ``(o [T, HV, V] in v's dtype, new_state [HV, K, V] fp32)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
BLOCK = 16  # diagonal block size of the triangular inverse
RECURRENT_MAX = 4  # pieces of up to this many tokens take the recurrent form
# On a CPU a piece's triangular systems always go to LAPACK's triangular solve. Against the batched-matmul
# inverse + matmul on a 2-core AMX Xeon (fp32, 2 threads, 64 x 64 systems, 256 right-hand columns, min of
# 12 calls), solve / inverse: 16 systems 0.37, 64 0.53, 256 0.71, 1,024 0.45, 2,048 0.39. (Before the solve
# was posed transposed, its copy of the right-hand sides made it lose from ~96 systems on.) On a 2-core
# AVX-512 EPYC the inverse wins (16 systems 0.79 against 1.03 ms, 48 systems 2.63 against 3.37), ~1% of a
# record: the solve stays on every CPU, so that a row's bits do not depend on the CPU's vendor. On other
# devices (the torch fallback on a GPU without fla) up to this many systems are solved and more are inverted.
SOLVE_MAX_SYSTEMS = 64
# Decay factors below FLUSH_BELOW are set to 0. torch's CPU exp computes an element whose result leaves the
# normal floats (below ~1.2e-38) one at a time, 60-170x slower than the rest, and the strong decays of
# trained models (A up to 16: tens per token) put most of a chunk's pair decays there; the subnormal
# factors it returns would then slow every matmul they enter. EXP_FLOOR < ln(FLUSH_BELOW): what is
# clamped there is flushed.
EXP_FLOOR = -87.0
FLUSH_BELOW = 2e-38


def decay_factors(log_decay: torch.Tensor, scratch: bool = False) -> torch.Tensor:
    """``exp(log_decay)`` for log decays ``<= 0`` (a positive entry gives 1: what lies above the diagonal
    of a chunk's pair decays), with factors below ``FLUSH_BELOW`` set to 0. ``scratch``: ``log_decay`` is
    a temporary the call may overwrite."""
    x = log_decay.clamp_(EXP_FLOOR, 0.0) if scratch else log_decay.clamp(EXP_FLOOR, 0.0)
    return F.threshold(x.exp_(), FLUSH_BELOW, 0.0, inplace=not torch.is_grad_enabled())


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    heads_v = v.shape[1]
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    repeat = heads_v // q.shape[1]
    if repeat > 1:
        q = q.repeat_interleave(repeat, dim=1)
        k = k.repeat_interleave(repeat, dim=1)
    q = q * q.shape[-1] ** -0.5
    # head-major [HV, T, d]
    return q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1)


def _initial_state(state: torch.Tensor | None, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if state is None:
        return q.new_zeros(v.shape[1], q.shape[-1], v.shape[-1], dtype=torch.float32)
    return state.float()


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form; cheapest for a handful of tokens (decode steps)."""
    out, s, _ = _recurrent(q, k, v, g, beta, state, keep=0)
    return out, s


def _recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    keep: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    out_dtype = v.dtype
    s = _initial_state(state, q, v).clone()
    qh, kh, vh = _prepare(q, k, v)
    decay = decay_factors(g.float().t())  # [HV, T]
    beta = beta.float().t()
    out = torch.empty_like(vh)
    kept = None
    for t in range(qh.shape[1]):
        if t == keep and keep:
            kept = s.clone()
        s.mul_(decay[:, t, None, None])
        k_t = kh[:, t]  # [HV, K]
        memory = torch.einsum("hkv,hk->hv", s, k_t)
        delta = (vh[:, t] - memory) * beta[:, t, None]
        s.add_(k_t[:, :, None] * delta[:, None, :])
        out[:, t] = torch.einsum("hkv,hk->hv", s, qh[:, t])
    return out.transpose(0, 1).to(out_dtype), s, kept


def unit_lower_inverse(strict: torch.Tensor) -> torch.Tensor:
    """``(I + strict)^-1`` for strictly lower triangular ``strict [..., C, C]`` (C a multiple of BLOCK).

    Diagonal BLOCK x BLOCK blocks are inverted with the exact finite Neumann product
    ``(I - L)(I + L^2)(I + L^4)(I + L^8)`` (L^16 = 0), then merged pairwise with
    ``[[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]``. Batched matmuls only: the batched
    LAPACK triangular solve is an order of magnitude slower on the CPU.
    """
    size = strict.shape[-1]
    batch = strict.shape[:-2]
    eye = torch.eye(BLOCK, dtype=strict.dtype, device=strict.device)
    blocks = size // BLOCK
    lower = torch.stack(
        [strict[..., i * BLOCK : (i + 1) * BLOCK, i * BLOCK : (i + 1) * BLOCK] for i in range(blocks)], dim=-3
    )
    inverse = eye - lower
    power = lower @ lower
    for _ in range(3):  # BLOCK = 16 = 2^4
        inverse = inverse + inverse @ power
        power = power @ power
    width = BLOCK
    while width < size:
        pairs = inverse.shape[-3] // 2
        first, second = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        below = torch.stack(
            [
                strict[..., (2 * j + 1) * width : (2 * j + 2) * width, 2 * j * width : (2 * j + 1) * width]
                for j in range(pairs)
            ],
            dim=-3,
        )
        corner = -(second @ below @ first)
        top = torch.cat((first, torch.zeros_like(first)), dim=-1)
        bottom = torch.cat((corner, second), dim=-1)
        inverse = torch.cat((top, bottom), dim=-2)
        width *= 2
    return inverse.reshape(*batch, size, size)


def solve_unit_lower(strict: torch.Tensor, rhs: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """``x`` with ``(I + strict) x = rhs`` for strictly lower triangular ``strict [..., C, C]``: the
    triangular solve (which reads only below the diagonal) on a CPU, and elsewhere for up to
    ``SOLVE_MAX_SYSTEMS`` systems; the batched-matmul inverse for more.

    The solve is posed transposed, ``x^T (I + strict)^T = rhs^T``: for the row-major ``rhs`` every caller
    builds, LAPACK (which works on column-major matrices) then reads ``rhs^T`` and ``strict^T`` as they lie,
    and the result comes back row-major. Posed as ``(I + strict) x = rhs``, torch first copies ``rhs`` into
    a column-major buffer, a transposing copy that took a third of the solve's time. ``overwrite``: ``rhs``
    is the caller's scratch, which the solve may write its result into (without autograd); the bits are
    the same either way."""
    systems = strict.numel() // (strict.shape[-1] * strict.shape[-2])
    if strict.device.type == "cpu" or systems <= SOLVE_MAX_SYSTEMS:
        rhs_t = rhs.mT
        into = rhs_t if overwrite and not torch.is_grad_enabled() else None
        return torch.linalg.solve_triangular(strict.mT, rhs_t, upper=True, left=False, unitriangular=True,
                                             out=into).mT
    return unit_lower_inverse(strict) @ rhs


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
    """Chunked (UT-transform) form; see :func:`_chunked`."""
    out, s, _ = _chunked(q, k, v, g, beta, state, past, chunk, keep=0)
    return out, s


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    past: int,
    chunk: int,
    keep: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Chunked (UT-transform) form: the intra-chunk work is batched matmuls, only chunks are scanned.

    Chunks are aligned to absolute positions (multiples of ``chunk`` counted from the sequence start, with
    ``past`` tokens already consumed), so a sequence run in pieces groups its arithmetic like a one-piece
    run: only the chunk that a piece boundary cuts is computed differently. Zero rows pad both ends; with
    k = 0 and beta = 0 they neither read nor change the state.

    The key-side products (``k k^T``, ``q k^T``) are computed once per key head and shared by its value
    heads, both right-hand sides of the triangular system share one matmul, and every operand of the scan
    is built in the layout its matmuls read (no transposed copies).

    ``keep`` (``0 < keep < T``): also return the state after the first ``keep`` tokens, as a call over just
    those tokens would leave it (see :func:`_state_inside_chunk`); 0: None.
    """
    out_dtype = v.dtype
    steps, key_heads, key_dim = q.shape
    heads, value_dim = v.shape[1], v.shape[2]
    grouped = (key_heads, heads // key_heads)  # value head j reads key head j // repeat
    front = past % chunk
    n = -(-(front + steps) // chunk)
    back = n * chunk - front - steps

    def chunked(x: torch.Tensor) -> torch.Tensor:
        """Token rows ``[T, heads, ...]`` as head-major zero-padded chunks ``[heads, n, C, ...]``."""
        x = x.transpose(0, 1)
        pad = (0, 0) * (x.dim() - 2) + (front, back)
        return F.pad(x, pad).reshape(x.shape[0], n, chunk, *x.shape[2:])

    q, k = q.float(), k.float()
    q = q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * key_dim**-0.5)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    qc, kc = chunked(q), chunked(k)  # per key head [H, n, C, K]
    gc = chunked(g.float()).cumsum(-1)  # [HV, n, C]: cumulative log decay inside each chunk
    bc = chunked(beta.float())[..., None]
    # exp(gc_i - gc_j) for j <= i, 0 above the diagonal (gc does not increase along a chunk: the entries above
    # it are the positive ones, which decay_factors caps at exp(0) before tril clears them)
    pair_decay = decay_factors(gc[..., :, None] - gc[..., None, :], scratch=True).tril()

    k_t = kc.transpose(-1, -2).contiguous()  # [H, n, K, C]
    gram = (kc @ k_t).unsqueeze(1)  # [H, 1, n, C, C], shared by the value heads of a key head
    scores = (qc @ k_t).unsqueeze(1)
    system = (gram * (pair_decay * bc).view(*grouped, n, chunk, chunk)).view(heads, n, chunk, chunk)
    system.diagonal(dim1=-2, dim2=-1).zero_()  # strictly lower: the unit diagonal is implied
    intra = (scores * pair_decay.view(*grouped, n, chunk, chunk)).view(heads, n, chunk, chunk)

    # one solve for both right-hand sides, [v * beta | k * beta * exp(gc)]
    gexp = decay_factors(gc)
    k_weight = (bc * gexp[..., None]).view(*grouped, n, chunk, 1)
    if torch.is_grad_enabled():  # autograd takes no out= arguments
        v_beta = chunked(v.float()).view(*grouped, n, chunk, value_dim) * bc.view(*grouped, n, chunk, 1)
        rhs = torch.cat((v_beta, kc.unsqueeze(1) * k_weight), dim=-1)
    else:  # both halves written in place, v * beta straight into the padded rows
        rhs = torch.empty(heads, n * chunk, value_dim + key_dim, device=q.device)
        rhs[:, :front, :value_dim] = 0
        rhs[:, front + steps :, :value_dim] = 0
        torch.mul(v.transpose(0, 1), beta.float().t()[..., None],  # a low-precision v widens exactly
                  out=rhs[:, front : front + steps, :value_dim])
        rhs = rhs.view(*grouped, n, chunk, value_dim + key_dim)
        torch.mul(kc.unsqueeze(1), k_weight, out=rhs[..., value_dim:])
    solved = solve_unit_lower(system, rhs.flatten(0, 1), overwrite=True)
    values, key_decay = solved[..., :value_dim], solved[..., value_dim:]

    q_decayed = (qc.unsqueeze(1) * gexp.view(*grouped, n, chunk, 1)).flatten(0, 1)
    last = gc[..., -1:]
    to_end = decay_factors(last - gc, scratch=True).view(*grouped, n, 1, chunk)
    k_to_end = (k_t.unsqueeze(1) * to_end).flatten(0, 1)  # [HV, n, K, C]
    chunk_decay = decay_factors(last)[..., None]  # [HV, n, 1, 1]

    s = _initial_state(state, q, v)
    # where the kept state lies: before chunk ``keep_chunk``, plus its first ``keep_rows`` rows
    keep_chunk, keep_rows = divmod(front + keep, chunk) if keep else (-1, 0)
    kept = None

    def state_inside(i: int, before: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        if not keep_rows:
            return before.clone()
        key_t = k_t[:, i].unsqueeze(1).expand(*grouped, key_dim, chunk).flatten(0, 1)
        return _state_inside_chunk(before, key_t, v_new, gc[:, i], keep_rows)

    if torch.is_grad_enabled():  # training differentiates through the scan: no in-place updates
        outs = []
        for i in range(n):
            v_new = torch.baddbmm(values[:, i], key_decay[:, i], s, alpha=-1)
            if i == keep_chunk:
                kept = state_inside(i, s, v_new)
            outs.append(torch.baddbmm(intra[:, i] @ v_new, q_decayed[:, i], s))
            s = torch.baddbmm(s * chunk_decay[:, i], k_to_end[:, i], v_new)
        out = torch.stack(outs)
    else:
        s = s.clone()
        out = torch.empty(n, heads, chunk, value_dim, dtype=torch.float32, device=q.device)
        for i in range(n):
            v_new = torch.baddbmm(values[:, i], key_decay[:, i], s, alpha=-1)
            if i == keep_chunk:
                kept = state_inside(i, s, v_new)
            torch.bmm(intra[:, i], v_new, out=out[i]).baddbmm_(q_decayed[:, i], s)
            s.mul_(chunk_decay[:, i]).baddbmm_(k_to_end[:, i], v_new)
    rows = out.new_empty(n * chunk, heads, value_dim, dtype=out_dtype)  # token-major and rounded in one copy
    rows.view(n, chunk, heads, value_dim).copy_(out.transpose(1, 2))
    return rows[front : front + steps], s, kept


def _state_inside_chunk(
    before: torch.Tensor, key_t: torch.Tensor, v_new: torch.Tensor, cum_decay: torch.Tensor, rows: int
) -> torch.Tensor:
    """The state after the first ``rows`` rows of a chunk, from the state ``before [HV, K, V]`` it, the
    chunk's keys ``key_t [HV, K, C]``, its corrected values ``v_new [HV, C, V]`` and cumulative log decays
    ``cum_decay [HV, C]``.

    Row ``j < rows`` of ``v_new`` depends only on rows ``<= j`` (the chunk's system is lower triangular),
    so it is what a call ending at ``rows`` computes; that call's last chunk is zero-padded after ``rows``,
    which is why the rows from ``rows`` on are zeroed here rather than cut: the matmul then has that call's
    shape and sums the same terms in the same order, and the state equals the one it leaves.
    """
    last = cum_decay[:, rows - 1 : rows]  # [HV, 1]
    to_point = decay_factors(last - cum_decay, scratch=True)
    to_point[:, rows:] = 0
    v_head = v_new.clone()
    v_head[:, rows:] = 0
    return torch.baddbmm(before * decay_factors(last)[..., None], key_t * to_point[:, None, :], v_head)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    past: int = 0,
    keep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One sequence: the recurrent form for a few tokens and the chunked form for many. ``keep``
    (``0 < keep < T``): the third value is the state after the first ``keep`` tokens (else None)."""
    if q.shape[0] <= RECURRENT_MAX:
        return _recurrent(q, k, v, g, beta, state, keep)
    if 0 < keep <= RECURRENT_MAX:  # a call over just those tokens would take the recurrent form
        out, final, _ = _chunked(q, k, v, g, beta, state, past, CHUNK, 0)
        return out, final, _recurrent(q[:keep], k[:keep], v[:keep], g[:keep], beta[:keep], state, 0)[1]
    return _chunked(q, k, v, g, beta, state, past, CHUNK, keep)


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor,
    seq_lens: tuple[int, ...],
    past_lens: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences' new tokens side by side (rows of sequence ``i`` follow those of ``i - 1``), each
    from its own state ``initial [B, HV, K, V]`` (zeros for a sequence that starts here): the reference,
    one :func:`gated_delta_rule` call per sequence. Returns ``(o [N, HV, V], final states [B, HV, K, V])``."""
    out, finals, _ = gated_delta_rule_varlen_keeping(q, k, v, g, beta, initial, seq_lens, past_lens,
                                                     (0,) * len(seq_lens))
    return out, finals


def gated_delta_rule_varlen_keeping(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor,
    seq_lens: tuple[int, ...],
    past_lens: tuple[int, ...],
    keep: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`gated_delta_rule_varlen` that also returns, for each sequence with ``0 < keep[i] < n``, its
    state after its first ``keep[i]`` new tokens (in sequence order): a prefix-cache snapshot inside a
    step, without running that sequence in two calls. The output rows are those of the plain call."""
    outs, finals, kept, start = [], [], [], 0
    for i, (n, past, d) in enumerate(zip(seq_lens, past_lens, keep, strict=True)):
        end = start + n
        out, final, inside = gated_delta_rule(q[start:end], k[start:end], v[start:end], g[start:end],
                                              beta[start:end], initial[i], past, d if 0 < d < n else 0)
        outs.append(out)
        finals.append(final)
        if inside is not None:
            kept.append(inside)
        start = end
    if len(outs) == 1:  # one sequence (a long record's piece): its rows as they are, not a copy
        return outs[0], finals[0][None], kept
    return torch.cat(outs), torch.stack(finals), kept


# the torch forms can keep states inside a piece; a replacement without this attribute (a GPU kernel, a fault
# wrapper) makes the layer run a capturing sequence in two calls instead
gated_delta_rule_varlen.keeping = gated_delta_rule_varlen_keeping  # type: ignore[attr-defined]

"""The gated delta rule token by token in float64 with plain ``exp`` (no flushing): the oracle that the
chunked torch reference and fla's kernels are both measured against."""

from __future__ import annotations

import torch


def delta_rule_float64(q, k, v, g, beta, state):
    """One sequence: ``q, k [T, H, K]``, ``v [T, HV, V]``, ``g, beta [T, HV]``, ``state [HV, K, V]``;
    returns ``(o [T, HV, V], final state)`` in float64."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, state))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    repeat = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(repeat, 1), k.repeat_interleave(repeat, 1)
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, s


def delta_rule_float64_varlen(q, k, v, g, beta, initial, lens):
    """Sequences packed along the token axis (``lens`` tokens each, ``initial [N, HV, K, V]``): outputs
    concatenated, final states stacked."""
    outs, states, start = [], [], 0
    for i, n in enumerate(lens):
        rows = slice(start, start + n)
        out, state = delta_rule_float64(q[rows], k[rows], v[rows], g[rows], beta[rows], initial[i])
        outs.append(out)
        states.append(state)
        start += n
    return torch.cat(outs), torch.stack(states)

"""Decays strong enough to leave the normal floats: ``decay_factors`` and the delta rule built on it."""

from __future__ import annotations

import pytest
import torch

from clefserve.model.ops.delta_rule import (
    CHUNK,
    EXP_FLOOR,
    FLUSH_BELOW,
    chunk_gated_delta_rule,
    decay_factors,
)
from tests.delta_oracle import delta_rule_float64


def test_decay_factors_equal_exp_where_normal_and_zero_below() -> None:
    x = torch.linspace(-120.0, 0.0, 24001)
    out = decay_factors(x)
    exact = torch.exp(x)
    kept = exact >= FLUSH_BELOW
    assert kept.any() and (~kept).any()
    assert torch.equal(out[kept], exact[kept])  # bit for bit
    assert torch.equal(out[~kept], torch.zeros_like(out[~kept]))
    assert torch.equal(decay_factors(torch.tensor([0.0, -0.0, 0.5, 40.0])), torch.ones(4))  # capped at exp(0)
    assert torch.isnan(decay_factors(torch.tensor([float("nan"), -1.0]))[0])


def test_scratch_and_gradients() -> None:
    x = torch.linspace(-100.0, 0.0, 1001)
    assert torch.equal(decay_factors(x.clone(), scratch=True), decay_factors(x))
    leaf = x.clone().requires_grad_()
    decay_factors(leaf).sum().backward()
    kept = x.exp() > FLUSH_BELOW  # what is flushed is a constant 0: no gradient there
    assert torch.allclose(leaf.grad[kept], x.exp()[kept])
    assert torch.equal(leaf.grad[~kept], torch.zeros_like(leaf.grad[~kept]))


@pytest.mark.parametrize("past", [0, 37])
def test_chunked_rule_with_decays_below_the_normal_floats_matches_the_recurrence(past) -> None:
    gen = torch.Generator().manual_seed(past)
    steps, heads, value_heads, dim = 300, 1, 2, 32
    q, k = (torch.randn(steps, heads, dim, generator=gen) for _ in range(2))
    v = torch.randn(steps, value_heads, dim, generator=gen)
    g = -torch.rand(steps, value_heads, generator=gen) * 40  # up to e^-40 a token, as Qwen3.5's strong heads
    beta = torch.rand(steps, value_heads, generator=gen)
    state = torch.randn(value_heads, dim, dim, generator=gen)
    assert (g[: CHUNK - past % CHUNK].cumsum(0) < EXP_FLOOR).any()  # a chunk's decays leave the normal floats
    with torch.inference_mode():
        out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, past)
    want_out, want_final = delta_rule_float64(q, k, v, g, beta, state)
    assert (out.double() - want_out).abs().max().item() <= 1e-5 * max(1.0, want_out.abs().max().item())
    assert (final.double() - want_final).abs().max().item() <= 1e-5 * max(1.0, want_final.abs().max().item())

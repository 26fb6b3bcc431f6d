"""Running a sequence in pieces from its carried state equals the one-piece run."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from clefserve.model.cache import DenseCache, SequenceState
from clefserve.model.layers import Batch
from clefserve.model.ops.delta_rule import (
    CHUNK,
    chunk_gated_delta_rule,
    gated_delta_rule,
    gated_delta_rule_varlen,
    gated_delta_rule_varlen_keeping,
    recurrent_gated_delta_rule,
)
from clefserve.model.weights import load_backbone
from tests import device as test_device
from tests.backbone_specs import BACKBONE_SPECS
from tests.kernel_modes import KERNEL_MODES, use_kernels

TOLERANCE = 1e-5


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("name", sorted(BACKBONE_SPECS))
@torch.inference_mode()
def test_random_pieces_equal_one_piece(make_release, name, mode):
    """A sequence run in random pieces gives the rows of one run: within 1e-5, or within two fp32 roundings of
    the model where one is larger (its rows' distance from an fp64 run; measured on an AVX-512 EPYC for
    qwen-decays: 7.7e-6 from fp64, 1.17e-5 between pieces and one run). A carried state that is lost or
    damaged moves them far more: one delta-rule state scaled by 0.999 once, by 1.8e-4."""
    folder = make_release(BACKBONE_SPECS[name], seed=len(name))
    model = use_kernels(load_backbone(folder, test_device.dtype(), test_device.device()), mode)
    exact = load_backbone(folder, torch.float64) if test_device.dtype() == torch.float32 else None
    rng = random.Random(name)
    gen = torch.Generator().manual_seed(11)
    for _ in range(2):
        ids = torch.randint(0, model.config.vocab_size, (rng.randint(1500, 2200),), generator=gen)
        whole, _ = model.run_sequence(ids)
        pieces, state, start = [], None, 0
        while start < len(ids):
            size = rng.choice([1, 2, 3, rng.randint(1, 64), rng.randint(1, 700)])
            hidden, state = model.run_sequence(ids[start : start + size], state)
            pieces.append(hidden)
            start += size
        assert state.length == len(ids)
        tolerance = TOLERANCE
        if exact is not None:  # no tighter than two fp32 roundings of this model (each measured against fp64)
            rounding = (whole.cpu().double() - exact.run_sequence(ids)[0]).abs().max().item()
            tolerance = max(TOLERANCE, 2 * rounding)
        test_device.assert_close(torch.cat(pieces), whole, tolerance, "pieces vs one piece:")


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("mode", KERNEL_MODES)
@torch.inference_mode()
def test_states_kept_inside_a_piece_equal_the_states_of_a_piece_cut_there(make_release, mode, split):
    """``Batch.captures``: a forward of two sequences that keeps each one's GDN state a few tokens into
    its piece gives the states that running the sequence up to there gives, and the same rows as without.
    ``split``: a delta-rule op that cannot keep states itself (a GPU kernel, a fault wrapper), so the layer
    runs each capturing sequence in two calls."""
    name = sorted(BACKBONE_SPECS)[0]
    folder = make_release(BACKBONE_SPECS[name], seed=7)
    model = use_kernels(load_backbone(folder, test_device.dtype(), test_device.device()), mode)
    ops = model.ops
    if split:
        rule = ops.gated_delta_rule
        model.set_ops(replace(ops, gated_delta_rule=lambda *args: rule(*args)))
    assert (getattr(model.ops.gated_delta_rule, "keeping", None) is None) == split or not test_device.on_cpu()
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    history = torch.randint(0, vocab, (150,), generator=gen)
    pieces = [torch.randint(0, vocab, (n,), generator=gen) for n in (200, 90)]
    splits = (133, 3)  # past a delta-rule chunk boundary, and within the recurrent form's reach
    _, carried = model.run_sequence(history)
    states = [carried.clone(), SequenceState()]
    lens, pasts = tuple(len(p) for p in pieces), (150, 0)
    device = test_device.device()
    ids = torch.cat(pieces).to(device)
    plain = model(ids, Batch(lens, pasts), DenseCache([s.clone() for s in states]))
    cache = DenseCache(states)
    kept_rows = model(ids, Batch(lens, pasts, captures=splits), cache)
    test_device.assert_close(kept_rows, plain, TOLERANCE, "rows with kept states vs without:")
    for seq, (start, piece, d) in enumerate(zip((carried, None), pieces, splits, strict=True)):
        _, cut = model.run_sequence(piece[:d], start.clone() if start is not None else None)
        assert tuple(sorted(cache.kept[seq])) == model.config.linear_layers
        for layer, (conv, recurrent) in cache.kept[seq].items():
            test_device.assert_close(conv, cut.conv[layer], TOLERANCE, f"conv state of layer {layer}:")
            test_device.assert_close(recurrent, cut.recurrent[layer], TOLERANCE, f"state of layer {layer}:")


def _delta_inputs(steps: int, heads: int, v_heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(steps, heads, dim, generator=gen), torch.randn(steps, heads, dim, generator=gen)
    v = torch.randn(steps, v_heads, dim, generator=gen)
    g = -torch.rand(steps, v_heads, generator=gen) * 2
    beta = torch.rand(steps, v_heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("v_heads", [2, 4])
def test_chunked_and_recurrent_delta_rule_agree(v_heads):
    q, k, v, g, beta = _delta_inputs(300, 2, v_heads, 16, seed=v_heads)
    state = torch.randn(v_heads, 16, 16)
    out_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, state, past=37)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert s_c.dtype == s_r.dtype == torch.float32
    assert (out_c - out_r).abs().max().item() <= 1e-5
    assert (s_c - s_r).abs().max().item() <= 1e-5


def test_recurrent_state_stays_fp32_for_low_precision_inputs():
    q, k, v, g, beta = _delta_inputs(80, 2, 2, 16, seed=1)
    out, state = chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, None)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32


# (tokens, past, keep): a cut inside a chunk, on a chunk boundary (absolute: past + keep), one the recurrent
# form would run, a cut in the last chunk, and a piece short enough for the recurrent form itself
KEEP_CASES = [(300, 37, 133), (200, 64, CHUNK), (200, 70, 58), (300, 0, 3), (700, 66, 699), (4, 10, 2)]


@pytest.mark.parametrize(("tokens", "past", "keep"), KEEP_CASES)
@pytest.mark.parametrize("v_heads", [2, 4])
@torch.inference_mode()
def test_a_state_kept_inside_a_call_is_the_state_of_a_call_cut_there(tokens, past, keep, v_heads):
    """The delta rule's kept state equals, bit for bit, what a call over just the first ``keep`` tokens
    leaves (so a sequence resumed from it computes what a cut piece would), and keeping it changes
    neither the output rows nor the final state."""
    q, k, v, g, beta = _delta_inputs(tokens, 2, v_heads, 32, seed=tokens + keep)
    state = torch.randn(v_heads, 32, 32, generator=torch.Generator().manual_seed(keep))
    out, final, kept = gated_delta_rule(q, k, v, g, beta, state, past, keep=keep)
    plain_out, plain_final, none = gated_delta_rule(q, k, v, g, beta, state, past)
    _, cut, _ = gated_delta_rule(q[:keep], k[:keep], v[:keep], g[:keep], beta[:keep], state, past)
    assert none is None and kept is not None
    assert torch.equal(kept, cut), f"max |diff| {(kept - cut).abs().max().item():.3g}"
    assert torch.equal(out, plain_out) and torch.equal(final, plain_final)


@torch.inference_mode()
def test_varlen_keeping_returns_the_kept_states_in_sequence_order():
    lens, pasts, keep = (300, 90, 150), (37, 0, 64), (133, 0, 64)
    q, k, v, g, beta = _delta_inputs(sum(lens), 2, 4, 16, seed=5)
    initial = torch.randn(len(lens), 4, 16, 16, generator=torch.Generator().manual_seed(2))
    out, finals, kept = gated_delta_rule_varlen_keeping(q, k, v, g, beta, initial, lens, pasts, keep)
    want_out, want_finals = gated_delta_rule_varlen(q, k, v, g, beta, initial, lens, pasts)
    assert torch.equal(out, want_out) and torch.equal(finals, want_finals)
    assert len(kept) == 2  # the sequence with keep 0 keeps nothing
    for state, (i, start) in zip(kept, ((0, 0), (2, 390)), strict=True):
        d = keep[i]
        rows = slice(start, start + d)
        _, cut, _ = gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], initial[i], pasts[i])
        assert torch.equal(state, cut)

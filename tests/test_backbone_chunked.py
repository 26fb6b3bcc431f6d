"""Running a sequence in pieces from its carried state equals the one-piece run."""

from __future__ import annotations

import random

import pytest
import torch

from clefserve.model.cache import DenseCache, SequenceState
from clefserve.model.layers import Batch
from clefserve.model.ops.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from clefserve.model.weights import load_backbone
from tests import device as test_device
from tests.backbone_specs import BACKBONE_SPECS
from tests.kernel_modes import KERNEL_MODES, use_kernels

TOLERANCE = 1e-5


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("name", sorted(BACKBONE_SPECS))
@torch.inference_mode()
def test_random_pieces_equal_one_piece(make_release, name, mode):
    folder = make_release(BACKBONE_SPECS[name], seed=len(name))
    model = use_kernels(load_backbone(folder, test_device.dtype(), test_device.device()), mode)
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
        test_device.assert_close(torch.cat(pieces), whole, TOLERANCE, "pieces vs one piece:")


@pytest.mark.parametrize("mode", KERNEL_MODES)
@torch.inference_mode()
def test_states_kept_inside_a_piece_equal_the_states_of_a_piece_cut_there(make_release, mode):
    """``Batch.captures``: a forward of two sequences that keeps each one's GDN state a few tokens into
    its piece gives the states that running the sequence up to there gives, and the same rows as without."""
    name = sorted(BACKBONE_SPECS)[0]
    folder = make_release(BACKBONE_SPECS[name], seed=7)
    model = use_kernels(load_backbone(folder, test_device.dtype(), test_device.device()), mode)
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

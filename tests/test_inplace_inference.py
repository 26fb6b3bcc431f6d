"""Without autograd, norms and layers overwrite their own intermediates in place: the results must equal the
autograd path's to the bit, and the caller's tensors must stay untouched."""

from __future__ import annotations

import pytest
import torch

from clefserve.model.cache import DenseCache, SequenceState
from clefserve.model.layers import Batch
from clefserve.model.ops.norms import gated_rms_norm, rms_norm_zero_centred
from clefserve.model.weights import load_backbone
from clefserve.testing.release import ReleaseSpec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _both_modes(fn, *args):
    with torch.enable_grad():
        graded = fn(*args)
    with torch.inference_mode():
        inplace = fn(*args)
    return graded, inplace


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 256), (37, 2, 128), (5, 3, 64)])
def test_norms_in_place_equal_the_autograd_path_and_leave_inputs(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    gate = torch.randn(*shape, generator=gen).to(dtype)
    weight = (torch.randn(shape[-1], generator=gen) * 0.1).to(dtype)
    strided = torch.randn(shape[0], 2 * shape[-1], generator=gen).to(dtype)[:, ::2]  # a non-contiguous input
    x0, gate0, strided0 = x.clone(), gate.clone(), strided.clone()
    for args in ((x, weight, 1e-6), (strided, weight, 1e-6)):
        graded, inplace = _both_modes(rms_norm_zero_centred, *args)
        assert inplace.dtype == dtype and torch.equal(graded, inplace)
    graded, inplace = _both_modes(gated_rms_norm, x, gate, weight + 1, 1e-6)
    assert inplace.dtype == dtype and torch.equal(graded, inplace)
    assert torch.equal(x, x0) and torch.equal(gate, gate0) and torch.equal(strided, strided0)
    # and they compute what the formulas say (fp32 arithmetic, rounded once at the end of each stage)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = ((weight + 1) * normed.to(dtype) * torch.nn.functional.silu(gate.float())).to(dtype)
    assert torch.equal(inplace, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_in_place_equal_the_autograd_path_and_leave_their_input(make_release, dtype):
    spec = ReleaseSpec(head=None, num_hidden_layers=4)
    model = load_backbone(make_release(spec, seed=2), dtype)
    ids = torch.randint(0, model.config.vocab_size, (50,), generator=torch.Generator().manual_seed(1))
    batch = Batch(seq_lens=(30, 20), past_lens=(0, 0))

    def run():
        return model(ids, batch, DenseCache([SequenceState(), SequenceState()]))

    graded, inplace = _both_modes(run)
    assert torch.equal(graded.detach(), inplace)
    x = torch.randn(50, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    x0 = x.clone()
    with torch.inference_mode():
        rope = model._rope(batch, x.device, dtype)
        cache = DenseCache([SequenceState(), SequenceState()])
        for layer in model.layers:  # linear-attention and full-attention layers
            layer(x, batch, rope, cache)
            assert torch.equal(x, x0)
    assert {layer.kind for layer in model.layers} == {"linear_attention", "full_attention"}

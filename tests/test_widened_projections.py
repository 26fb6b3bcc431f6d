"""bf16/f16 projection weights held in fp32 where this CPU computes such projections in fp32
(:mod:`clefserve.model.ops.gemm`): the same bits as widening them per call, and the memory they take
accounted for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clefserve.model import weights
from clefserve.model.layers import Linear
from clefserve.model.ops import gemm
from clefserve.model.weights import load_backbone
from clefserve.testing.release import ReleaseSpec


@pytest.fixture
def bf16_release(make_release):
    return make_release(ReleaseSpec(head=None), seed=5, dtype=torch.bfloat16)  # weights file-mapped as loaded


def _projections(model) -> dict[str, torch.Tensor]:
    return {name: m.weight for name, m in model.layers.named_modules() if isinstance(m, Linear)}


def _chunked_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        first, state = model.run_sequence(ids[:300])
        second, _ = model.run_sequence(ids[300:], state)
    return torch.cat((first, second))


def test_fp32_copies_of_the_projection_weights_give_the_same_bits(bf16_release, monkeypatch):
    # as on a CPU without bf16 GEMM instructions, where bf16 projections compute in fp32 (on one with them,
    # per_call would run native bf16 GEMMs, whose roundings differ)
    monkeypatch.setattr(gemm, "native_low_precision", lambda d: False)
    per_call = load_backbone(bf16_release, torch.bfloat16, widen=False)
    held = load_backbone(bf16_release, torch.bfloat16, widen=True)
    narrow, wide = _projections(per_call), _projections(held)
    assert len(wide) >= 4 * per_call.config.num_hidden_layers // 2
    for name, weight in wide.items():
        assert weight.dtype == torch.float32 and narrow[name].dtype == torch.bfloat16
        assert torch.equal(weight, narrow[name].float()), name
    assert held.dtype == held.lm_head.weight.dtype == torch.bfloat16  # only the layers widen

    ids = torch.randint(0, held.config.vocab_size, (700,), generator=torch.Generator().manual_seed(1))
    expected, got = _chunked_hidden(per_call, ids), _chunked_hidden(held, ids)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)

    # the bf16 originals were the file's memory; the fp32 copies are the process's
    widened = sum(w.numel() for w in narrow.values())
    assert held.weight_bytes == per_call.weight_bytes + 2 * widened
    assert held.file_mapped_bytes == per_call.file_mapped_bytes - 2 * widened > 0


def test_projection_weights_stay_low_precision_when_their_copies_would_not_fit(bf16_release, monkeypatch):
    model = load_backbone(bf16_release, torch.bfloat16, widen=False)
    need = gemm.widened_bytes([m for m in model.layers.modules() if isinstance(m, Linear)])
    monkeypatch.setattr(weights, "available_memory", lambda device: int(need / gemm.WIDEN_SHARE) - 1)
    kept = load_backbone(bf16_release, torch.bfloat16, widen=True)
    assert {w.dtype for w in _projections(kept).values()} == {torch.bfloat16}
    monkeypatch.setattr(weights, "available_memory", lambda device: int(need / gemm.WIDEN_SHARE) + 1)
    assert {w.dtype for w in _projections(load_backbone(bf16_release, torch.bfloat16, widen=True)).values()} \
        == {torch.float32}


@pytest.mark.parametrize(("native", "dtype", "widened"), [
    (False, torch.bfloat16, True),
    (True, torch.bfloat16, False),
    (False, torch.float32, False),
])
def test_weights_widen_by_default_only_where_the_cpu_computes_the_dtype_in_fp32(
        bf16_release, monkeypatch, native, dtype, widened):
    monkeypatch.setattr(gemm, "native_low_precision", lambda d: native)
    model = load_backbone(bf16_release, dtype)
    want = torch.float32 if widened or dtype == torch.float32 else dtype
    assert {w.dtype for w in _projections(model).values()} == {want}


@pytest.mark.parametrize("widen", [True, False])
def test_the_mlp_rounds_once_where_projections_compute_in_fp32(bf16_release, widen):
    """On the fp32 path the SwiGLU block computes in fp32 from its input to its output and rounds once (a
    rounding of gate, up or their product is a pass over memory there); with fast bf16 GEMMs it stays bf16."""
    model = load_backbone(bf16_release, torch.bfloat16, widen=widen)
    mlp = model.layers[0].mlp
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.inference_mode():
        got = mlp(x)
    with torch.enable_grad():
        graded = mlp(x).detach()
    gate, up, down = (m.weight.float() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    wide = x.float()
    fp32_inside = F.linear(F.silu(F.linear(wide, gate)) * F.linear(wide, up), down).bfloat16()
    product = F.silu(F.linear(wide, gate).bfloat16()) * F.linear(wide, up).bfloat16()
    rounded = F.linear(product.float(), down).bfloat16()  # every intermediate rounded, as bf16 GEMMs do
    assert not torch.equal(fp32_inside, rounded)  # the two numerics are told apart on these inputs
    want = fp32_inside if gemm.upcasts(x, mlp.gate_proj.weight) else mlp.down_proj(
        F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(graded, want)

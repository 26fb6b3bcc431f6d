"""flash-linear-attention's kernels behind our op signatures equal the torch reference ops.

Runs where fla's Triton kernels can run: with ``--device cuda`` on a GPU, or on a CPU under Triton's
interpreter in the separate kernel environment (``bash scripts/test_kernels.sh``: ``TRITON_INTERPRET=1``,
fla and triton installed). Skipped in the normal CPU test environment, where fla and triton must stay
uninstalled (and must never be imported: transformers' CPU Qwen3.5 would route into them). Under the
interpreter: fp32 and f16 only (it computes bf16 wrongly), and few, short calls (a chunk call takes seconds).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from clefserve.model.device import device_facts
from clefserve.model.ops import conv, triton_interpreter
from clefserve.model.ops.delta_rule import gated_delta_rule_varlen
from clefserve.model.ops.faults import zeroed_band_ops
from clefserve.model.ops.select import fla_unavailable, select_ops
from tests import device as test_device
from tests.delta_oracle import delta_rule_float64_varlen

DEVICE = test_device.device()
_why = fla_unavailable(device_facts(DEVICE), torch.float32)
if _why is not None:
    pytest.skip(f"fla kernels cannot run here: {_why}", allow_module_level=True)
if DEVICE.type == "cpu":
    triton_interpreter.prepare()
assert importlib.util.find_spec("fla") is not None
from clefserve.model.ops import fla_ops  # noqa: E402

INTERPRETED = DEVICE.type == "cpu"
DTYPES = [torch.float32, torch.float16] if INTERPRETED else [torch.float32, torch.float16, torch.bfloat16]
# The delta rule's tolerances hold against the float64 oracle, for fla and for our reference alike. fp32: both
# are within ~6e-7 of it on these cases (one-ulp changes of q, k or g move the outputs by up to 1e-6), but
# one CI host put fla and our reference 1.5e-5 apart on the 70-token case, so the bound leaves room for a
# host's rounding. What a wrong kernel gives, measured here: decays 1% off 1e-3, beta 0.1% off 2.5e-4 or
# more, keys rounded to tf32 3e-5 to 1e-4 (final states 2e-4), a zeroed conv band 1e-1.
# Low precision: q, k, v rounded to the dtype before either side runs, the oracle reads the same values.
TOLERANCE = {torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
STATE_TOLERANCE = TOLERANCE
CONV_TOLERANCE = {torch.float32: 4e-5, torch.float16: 2e-2, torch.bfloat16: 1.2e-1}  # against our conv


def _delta_inputs(lens, pasts, heads, v_heads, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lens)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    k = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    v = torch.randn(rows, v_heads, dim, generator=gen).to(dtype)
    g = -torch.rand(rows, v_heads, generator=gen) * 2
    beta = torch.rand(rows, v_heads, generator=gen)
    initial = torch.randn(len(lens), v_heads, dim, dim, generator=gen) * 0.3
    for i, past in enumerate(pasts):
        if past == 0:
            initial[i] = 0
    return [x.to(DEVICE) for x in (q, k, v, g, beta, initial)]


CASES = [  # (seq_lens, past_lens, key heads, value heads)
    ((70,), (0,), 2, 4),
    ((1, 1, 1), (3, 0, 9), 2, 2),
    ((64, 5, 65), (0, 130, 7), 1, 2),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lens", "pasts", "heads", "v_heads"), CASES)
def test_fla_delta_rule_equals_the_reference(lens, pasts, heads, v_heads, dtype):
    q, k, v, g, beta, initial = _delta_inputs(lens, pasts, heads, v_heads, 16, dtype, seed=sum(lens))
    out, state = fla_ops.gated_delta_rule(q, k, v, g, beta, initial, lens, pasts)
    ours_out, ours_state = gated_delta_rule_varlen(q, k, v, g, beta, initial, lens, pasts)
    true_out, true_state = delta_rule_float64_varlen(q, k, v, g, beta, initial, lens)
    assert out.dtype == dtype and state.dtype == torch.float32
    assert out.shape == ours_out.shape == true_out.shape
    assert state.shape == ours_state.shape == true_state.shape
    errors = {
        "fla output": _off(out, true_out), "fla state": _off(state, true_state),
        "reference output": _off(ours_out, true_out), "reference state": _off(ours_state, true_state),
        "fla - reference output": _off(out, ours_out),
    }
    assert errors["fla output"] <= TOLERANCE[dtype], errors
    assert errors["fla state"] <= STATE_TOLERANCE[dtype], errors
    assert errors["reference output"] <= TOLERANCE[dtype], errors
    assert errors["reference state"] <= STATE_TOLERANCE[dtype], errors


def _off(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fla_conv_equals_the_reference_with_and_without_a_state(dtype):
    gen = torch.Generator().manual_seed(4)
    channels, kernel = 40, 4
    weight = torch.randn(channels, kernel, generator=gen).to(DEVICE, dtype)
    for steps in (1, 2, 3, 70):
        x = torch.randn(steps, channels, generator=gen).to(DEVICE, dtype)
        for state in (None, torch.randn(kernel - 1, channels, generator=gen).to(DEVICE, dtype)):
            out, new_state = fla_ops.causal_conv1d(x, weight, state)
            want, want_state = conv.causal_conv1d(x, weight, state)
            assert out.shape == want.shape and new_state.shape == want_state.shape
            assert (out.float() - want.float()).abs().max().item() <= CONV_TOLERANCE[dtype], (steps, state)
            assert torch.equal(new_state, want_state)  # the carried inputs are copied, not computed


def test_fast_kernels_are_selected_with_their_reason():
    ops = select_ops(DEVICE, torch.float32, "fast")
    assert ops.kernels()["gated_delta_rule"] == "fla_ops.gated_delta_rule"
    assert ops.kernels()["causal_conv1d"] == "fla_ops.causal_conv1d"
    reasons = dict(ops.reasons)
    assert "fla" in reasons["gated_delta_rule"] and "fla" in reasons["causal_conv1d"]


@torch.inference_mode()
def test_a_backbone_on_the_fla_kernels_equals_the_reference_and_the_fault_hook_still_bites(make_release):
    """One tiny backbone, run in two pieces on the fast ops: equal to the reference; with the historical
    conv fault (CLEF_FAULT_ZERO_CONV_BAND=k) on top of the fast ops, visibly different."""
    from clefserve.model.weights import load_backbone
    from clefserve.testing.release import ReleaseSpec

    spec = ReleaseSpec(head=None, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    model = load_backbone(make_release(spec, seed=5), device=DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    want, _ = model.run_sequence(ids)
    fast = select_ops(DEVICE, torch.float32, "fast")
    model.set_ops(fast)
    first, state = model.run_sequence(ids[:27])
    second, _ = model.run_sequence(ids[27:], state)
    got = torch.cat((first, second))
    assert (got - want).abs().max().item() <= 1e-4
    model.set_ops(zeroed_band_ops(model.config, "k", base=fast))
    faulty, _ = model.run_sequence(ids)
    assert (faulty - want).abs().max().item() > 0.1

"""The causal conv rounds where the reference does: taps summed in fp32, the sum rounded once to the input
dtype, then SiLU. The reference's ``nn.Conv1d`` (oneDNN on a CPU) and fla's Triton kernel both work that
way; summing in bf16 or fp16 rounds after every tap and puts about a third of the outputs one unit off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clefserve.model.ops.conv import causal_conv1d

CHANNELS, KERNEL = 96, 4
# Where fp32 sums in another order round to the other side of a low-precision rounding boundary. Measured:
# 0 of 524,288 outputs; summing in the low-precision dtype puts 32% of them off.
MAX_OFF_FRACTION = 1e-3


def _inputs(steps: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, CHANNELS, generator=gen).to(dtype)
    weight = (torch.randn(CHANNELS, KERNEL, generator=gen) * 0.5).to(dtype)
    state = torch.randn(KERNEL - 1, CHANNELS, generator=gen).to(dtype)
    return x, weight, state


def _reference_layer(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """What transformers' Qwen3.5 runs on a CPU: a depthwise ``F.conv1d`` over [state | x], then SiLU."""
    window = torch.cat((state, x)).t()[None]  # [1, C, K-1+T]
    out = F.conv1d(window, weight[:, None, :], groups=weight.shape[0])
    return F.silu(out[0].t())


def _oracle(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The sum in float64, rounded once to the input dtype, then SiLU in that dtype."""
    window = torch.cat((state, x)).double()
    taps = weight.double().t()
    total = sum(window[tap : tap + x.shape[0]] * taps[tap] for tap in range(KERNEL))
    return F.silu(total.to(x.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("steps", [1, 3, 300])
def test_low_precision_conv_rounds_once_like_the_reference(dtype, steps):
    x, weight, state = _inputs(steps, dtype, seed=steps)
    out, new_state = causal_conv1d(x, weight, state)
    assert out.dtype == dtype and new_state.dtype == dtype
    for name, want in (("reference layer", _reference_layer(x, weight, state)),
                       ("float64 oracle", _oracle(x, weight, state))):
        off = out != want
        assert off.float().mean().item() <= MAX_OFF_FRACTION, (name, int(off.sum()), out.numel())
        # where a different fp32 summation order flips a rounding, one unit of the dtype at most
        unit = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((out.float() - want.float()).abs() <= unit).all(), name


def test_fp32_conv_equals_the_float64_sum():
    x, weight, state = _inputs(300, torch.float32, seed=7)
    out, _ = causal_conv1d(x, weight, state)
    want = F.silu(sum(torch.cat((state, x)).double()[tap : tap + 300] * weight.double().t()[tap]
                      for tap in range(KERNEL)))
    assert (out.double() - want).abs().max().item() <= 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_carried_state_is_the_exact_last_inputs(dtype):
    x, weight, state = _inputs(10, dtype, seed=3)
    whole, whole_state = causal_conv1d(x, weight, state)
    first, carried = causal_conv1d(x[:6], weight, state)
    assert torch.equal(carried, x[3:6])
    second, second_state = causal_conv1d(x[6:], weight, carried)
    assert torch.equal(torch.cat((first, second)), whole)  # a sequence run in pieces: the same bits
    assert torch.equal(second_state, whole_state) and torch.equal(whole_state, x[-3:])
    fresh, _ = causal_conv1d(x, weight, None)
    zeros, _ = causal_conv1d(x, weight, torch.zeros_like(state))
    assert torch.equal(fresh, zeros)


def test_conv_gradients_equal_the_reference_layers():
    """The demo's training script backpropagates through the conv: gradients for the input, the weights
    and the carried state equal those of ``F.conv1d`` (fp32, within 1e-5)."""
    ours_inputs = [t.requires_grad_() for t in _inputs(40, torch.float32, seed=11)]
    theirs_inputs = [t.detach().clone().requires_grad_() for t in ours_inputs]
    out, new_state = causal_conv1d(*ours_inputs)
    (out.square().sum() + new_state.sum()).backward()
    x, weight, state = theirs_inputs
    want = _reference_layer(x, weight, state)
    (want.square().sum() + torch.cat((state, x))[-(KERNEL - 1):].sum()).backward()
    for ours, theirs in zip(ours_inputs, theirs_inputs, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5)

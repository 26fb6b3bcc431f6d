"""Our backbone computes the same function as transformers' Qwen3.5, layer for layer (fp32)."""

from __future__ import annotations

import pytest
import torch

from clefserve.model.weights import load_backbone
from tests import device as test_device
from tests.backbone_specs import BACKBONE_SPECS
from tests.kernel_modes import KERNEL_MODES, use_kernels
from tests.oracles import reference_backbone, reference_text_model

LENGTHS = (1, 63, 64, 65, 1536)
TOLERANCE = 1e-4
# Every layer must move the residual stream by at least this share of its norm, so that a wrong or
# skipped layer cannot hide behind the others.
MIN_LAYER_CHANGE = 0.05


CASES = [(spec, mode) for spec in sorted(BACKBONE_SPECS) for mode in KERNEL_MODES]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, make_release):
    name, mode = request.param
    folder = make_release(BACKBONE_SPECS[name], seed=len(name))
    dtype, device = test_device.dtype(), test_device.device()
    ours = use_kernels(load_backbone(folder, dtype, device), mode)
    return ours, reference_backbone(folder, dtype).to(device)


@torch.inference_mode()
def test_hidden_states_and_logits_match_transformers(pair):
    ours, ref = pair
    gen = torch.Generator().manual_seed(7)
    for length in LENGTHS:
        ids = torch.randint(0, ours.config.vocab_size, (length,), generator=gen)
        expected = reference_text_model(ref)(input_ids=ids[None].to(ours.device),
                                             use_cache=False).last_hidden_state[0]
        hidden, _ = ours.run_sequence(ids)
        test_device.assert_close(hidden, expected, TOLERANCE, f"hidden rows at length {length}:")
        ref_logits = ref.lm_head(expected)
        allowed = test_device.tolerance(TOLERANCE * 10) * ref_logits.float().abs().max()
        assert (ours.logits(hidden) - ref_logits).float().abs().max().item() <= allowed
        test_device.assert_close(ours.logits(hidden), ref.lm_head(hidden), TOLERANCE, "lm_head:")


@torch.inference_mode()
def test_every_layer_visibly_changes_the_hidden_state(pair):
    """How the random weights were checked: transformers' per-layer hidden states, relative change."""
    _, ref = pair
    ids = torch.randint(0, 500, (256,), generator=torch.Generator().manual_seed(3))
    states = reference_text_model(ref)(
        input_ids=ids[None], use_cache=False, output_hidden_states=True
    ).hidden_states
    # states[0] is the embedding output; the last entry has the final norm applied
    layers = len(states) - 2
    for i in range(layers):
        change = ((states[i + 1] - states[i]).norm() / states[i].norm()).item()
        assert change >= MIN_LAYER_CHANGE, f"layer {i} changes the hidden state by only {change:.3f}"


@torch.inference_mode()
def test_logits_of_a_causal_lm_folder_match(make_release):
    folder = make_release(BACKBONE_SPECS["causal-lm-tied"], seed=len("causal-lm-tied"))
    dtype, device = test_device.dtype(), test_device.device()
    ours, ref = load_backbone(folder, dtype, device), reference_backbone(folder, dtype).to(device)
    ids = torch.randint(0, ours.config.vocab_size, (100,), generator=torch.Generator().manual_seed(1))
    expected = ref(input_ids=ids[None].to(device), use_cache=False).logits[0]
    hidden, _ = ours.run_sequence(ids)
    test_device.assert_close(ours.logits(hidden), expected, TOLERANCE, "logits:")

"""Half-precision runs stay close to the fp32 run on the same inputs."""

from __future__ import annotations

import pytest
import torch

from clefserve.model.weights import load_backbone
from tests.backbone_specs import BACKBONE_SPECS

# relative error = ||h_low - h_fp32|| / ||h_fp32|| over all hidden rows of the sequence
TOLERANCE = 2e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(BACKBONE_SPECS))
@torch.inference_mode()
def test_low_precision_within_tolerance_of_fp32(make_release, name, dtype):
    folder = make_release(BACKBONE_SPECS[name], seed=len(name))
    reference = load_backbone(folder)
    model = load_backbone(folder, dtype=dtype)
    assert model.dtype == dtype
    ids = torch.randint(0, reference.config.vocab_size, (1200,), generator=torch.Generator().manual_seed(2))
    expected, _ = reference.run_sequence(ids)
    # in pieces too, so the carried low-precision state is exercised
    first, state = model.run_sequence(ids[:700])
    second, state = model.run_sequence(ids[700:], state)
    assert all(r.dtype == torch.float32 for r in state.recurrent.values())
    hidden = torch.cat((first, second)).float()
    assert torch.isfinite(hidden).all()
    relative = ((hidden - expected).norm() / expected.norm()).item()
    assert relative <= TOLERANCE

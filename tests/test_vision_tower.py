"""Our vision tower computes transformers' ``Qwen3_5VisionModel`` (fp32, within 1e-4) on random configs."""

from __future__ import annotations

import pytest
import torch

from clefserve.testing.release import vision_tensors
from clefserve.vision.config import VisionConfig
from clefserve.vision.tower import VisionTower, merge_block_order

TOLERANCE = 1e-4
CONFIGS = {
    "small": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=64),
    "qwen-like-heads": dict(depth=3, hidden_size=128, intermediate_size=320, num_heads=2,
                            num_position_embeddings=2304),
    "patch14-merge1-t1-gelu": dict(depth=1, hidden_size=48, intermediate_size=96, num_heads=3, patch_size=14,
                                   temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=100,
                                   hidden_act="gelu"),
    "merge3-silu-theta": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4,
                              spatial_merge_size=3, num_position_embeddings=36, hidden_act="silu"),
}
# by merge size: pictures of several shapes side by side (one call), and a two-frame entry (t = 2)
GRIDS = {1: [(1, 3, 5), (1, 1, 1), (2, 2, 3), (1, 7, 4)],
         2: [(1, 4, 6), (1, 8, 2), (2, 4, 4), (1, 2, 2), (1, 14, 10)],
         3: [(1, 6, 9), (1, 3, 3), (2, 6, 3)]}


def _pair(name: str, seed: int) -> tuple[VisionTower, torch.nn.Module, VisionConfig]:
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    kwargs = dict(CONFIGS[name], out_hidden_size=40)
    if name == "merge3-silu-theta":
        rope = {"rope_type": "axial", "rope_theta": 500.0}
        ref_config = Qwen3_5VisionConfig(**kwargs, rope_parameters=rope)
        config = VisionConfig(**kwargs, rope_theta=500.0)
    else:
        ref_config = Qwen3_5VisionConfig(**kwargs)
        config = VisionConfig(**kwargs)
    config.validate(40)
    weights = {k.removeprefix("model.visual."): v for k, v in vision_tensors(config, seed).items()}
    ref = Qwen3_5VisionModel(ref_config).eval()
    ref.load_state_dict(weights, strict=True)
    ours = VisionTower(config).eval()
    ours.load_state_dict(weights, strict=True)
    return ours, ref, config


@pytest.mark.parametrize("name", sorted(CONFIGS))
@torch.inference_mode()
def test_tower_matches_transformers(name: str) -> None:
    ours, ref, config = _pair(name, seed=len(name))
    merge = config.spatial_merge_size
    grids = GRIDS[merge]
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, config.patch_values, generator=torch.Generator().manual_seed(1))
    expected = ref(pixels, grid_thw=torch.tensor(grids)).pooler_output
    got = ours(pixels, grids)
    assert got.shape == expected.shape == (patches // merge**2, 40)
    assert (got - expected).abs().max().item() <= TOLERANCE
    # one picture on its own gives its rows of the joint call (attention never crosses pictures)
    start = 0
    for grid in grids:
        rows = grid[0] * grid[1] * grid[2]
        alone = ours.encode(pixels[start:start + rows], grid)
        first = start // merge**2
        assert (alone - expected[first:first + rows // merge**2]).abs().max().item() <= TOLERANCE
        start += rows


@torch.inference_mode()
def test_every_part_of_the_tower_matters() -> None:
    """A picture's rows move when any block, the position grid or the merger changes (no dead paths)."""
    ours, _, config = _pair("small", seed=3)
    pixels = torch.randn(48, config.patch_values, generator=torch.Generator().manual_seed(2))
    base = ours.encode(pixels, (1, 6, 8))
    for name, param in ours.named_parameters():
        saved = param.detach().clone()
        param.add_(0.2 * torch.randn_like(param))
        changed = (ours.encode(pixels, (1, 6, 8)) - base).abs().max().item()
        param.copy_(saved)
        assert changed > 1e-3, f"{name} does not change the output"


def test_merge_block_order() -> None:
    rows, cols = merge_block_order(4, 6, 2)
    pairs = list(zip(rows.tolist(), cols.tolist(), strict=True))
    assert pairs[:8] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    assert sorted(pairs) == [(r, c) for r in range(4) for c in range(6)]

"""The backbone with picture rows and M-RoPE positions equals transformers' ``Qwen3_5Model`` (fp32, 1e-4),
in one piece and in pieces of random lengths that cut through the pictures' token spans."""

from __future__ import annotations

import random

import pytest
import torch

from clefserve.model.inputs import SequenceInputs
from clefserve.model.weights import load_backbone
from clefserve.testing.release import ReleaseSpec, VisionSpec
from clefserve.vision.positions import ImageSpan, mrope_positions
from clefserve.vision.weights import load_vision_tower
from tests.oracles import reference_backbone

TOLERANCE = 1e-4
L, F = "linear_attention", "full_attention"
SPECS = {
    "default-vision": ReleaseSpec(head=None, head_dim=32, partial_rotary_factor=0.5, vision=VisionSpec()),
    "two-attn-wide-rope": ReleaseSpec(
        head=None, num_hidden_layers=5, layer_types=[L, F, L, F, L], head_dim=48, partial_rotary_factor=0.5,
        linear_num_key_heads=1, linear_num_value_heads=2,
        vision=VisionSpec(depth=1, hidden_size=48, num_heads=3, num_position_embeddings=36),
    ),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def models(request, make_release):
    folder = make_release(SPECS[request.param], seed=len(request.param))
    ref = reference_backbone(folder)
    return load_backbone(folder), load_vision_tower(folder), ref


def random_record(rng: random.Random, config, vision) -> tuple[list[int], list[ImageSpan], list]:
    merge = vision.config.spatial_merge_size
    ids: list[int] = [rng.randrange(600) for _ in range(rng.randint(3, 30))]
    spans, grids = [], []
    for _ in range(rng.randint(1, 3)):
        grid = (1, merge * rng.randint(1, 6), merge * rng.randint(1, 6))
        ids.append(vision.config.vision_start_token_id)
        span = ImageSpan(len(ids), grid, merge)
        ids.extend([vision.config.image_token_id] * span.length)
        ids.append(vision.config.vision_end_token_id)
        ids.extend(rng.randrange(600) for _ in range(rng.randint(0, 10)))
        spans.append(span)
        grids.append(grid)
    ids.extend(rng.randrange(600) for _ in range(rng.randint(1, 40)))
    return ids, spans, grids


@torch.inference_mode()
def test_backbone_with_pictures_matches_transformers(models) -> None:
    ours, tower, ref = models
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for trial in range(3):
        ids, spans, grids = random_record(rng, ours.config, tower)
        patches = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(patches, tower.config.patch_values, generator=gen)
        token_types = torch.tensor([[int(i == tower.config.image_token_id) for i in ids]])
        expected = ref.model(
            input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=token_types, use_cache=False,
        ).last_hidden_state[0]
        rows, start = [], 0
        for t, h, w in grids:
            rows.append(tower.encode(pixels[start:start + t * h * w], (t, h, w)))
            start += t * h * w
        inputs = SequenceInputs(embeds=tuple((s.start, r) for s, r in zip(spans, rows, strict=True)),
                                positions=mrope_positions(len(ids), spans))
        whole, _ = ours.run_sequence(torch.tensor(ids), inputs=inputs)
        assert (whole - expected).abs().max().item() <= TOLERANCE, trial
        # pieces of random lengths, and a cut through the middle of every picture
        middles = {s.start + s.length // 2 for s in spans if s.length > 1}
        cuts = sorted(set(rng.sample(range(1, len(ids)), k=min(4, len(ids) - 1))) | middles)
        state, pieces = None, []
        for lo, hi in zip([0, *cuts], [*cuts, len(ids)], strict=True):
            hidden, state = ours.run_sequence(torch.tensor(ids[lo:hi]), state, inputs=inputs)
            pieces.append(hidden)
        assert (torch.cat(pieces) - expected).abs().max().item() <= TOLERANCE, (trial, cuts)


@torch.inference_mode()
def test_positions_matter(models) -> None:
    """The M-RoPE positions change the answer (text positions in their place would be wrong)."""
    ours, tower, _ = models
    ids, spans, _ = random_record(random.Random(5), ours.config, tower)
    rows = [torch.randn(s.length, ours.config.hidden_size) for s in spans]
    embeds = tuple((s.start, r) for s, r in zip(spans, rows, strict=True))
    positions = mrope_positions(len(ids), spans)
    right, _ = ours.run_sequence(torch.tensor(ids), inputs=SequenceInputs(embeds, positions))
    wrong, _ = ours.run_sequence(torch.tensor(ids), inputs=SequenceInputs(embeds, None))
    assert (right - wrong).abs().max().item() > 1e-2

"""M-RoPE positions equal transformers' ``Qwen3_5Model.get_rope_index`` on random record layouts."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from clefserve.vision.positions import ImageSpan, mrope_positions

IMAGE, START, END, TEXT = 9, 7, 8, 1


def reference_positions(ids: list[int], grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    fake = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)),
        get_vision_position_ids=lambda *a, **k: Qwen3_5Model.get_vision_position_ids(None, *a, **k),
    )
    input_ids = torch.tensor([ids])
    token_types = (input_ids == IMAGE).long()
    positions, _ = Qwen3_5Model.get_rope_index(
        fake, input_ids, token_types, image_grid_thw=torch.tensor(grids) if grids else None
    )
    return positions[:, 0]


def random_record(rng: random.Random, merge: int) -> tuple[list[int], list[ImageSpan]]:
    ids: list[int] = [TEXT] * rng.randint(0, 40)
    spans = []
    for _ in range(rng.randint(0, 4)):
        grid = (1, merge * rng.randint(1, 9), merge * rng.randint(1, 9))
        ids.append(START)
        span = ImageSpan(len(ids), grid, merge)
        ids.extend([IMAGE] * span.length)
        ids.append(END)
        ids.extend([TEXT] * rng.randint(0, 12))
        spans.append(span)
    ids.extend([TEXT] * rng.randint(1, 30))
    return ids, spans


def test_positions_equal_get_rope_index() -> None:
    rng = random.Random(0)
    for trial in range(60):
        merge = (1, 2, 2, 3)[trial % 4]
        ids, spans = random_record(rng, merge)
        expected = reference_positions(ids, [s.grid for s in spans], merge)
        assert torch.equal(mrope_positions(len(ids), spans), expected), (trial, spans)


def test_text_after_a_picture_continues_from_its_larger_side() -> None:
    # 3 text tokens, a picture of 2 x 5 merged tokens, then text
    span = ImageSpan(3, (1, 4, 10), 2)
    positions = mrope_positions(3 + span.length + 2, [span])
    assert positions[:, :3].tolist() == [[0, 1, 2]] * 3
    assert positions[0, 3:13].tolist() == [3] * 10
    assert positions[1, 3:13].tolist() == [3] * 5 + [4] * 5
    assert positions[2, 3:13].tolist() == [3, 4, 5, 6, 7] * 2
    assert positions[:, 13:].tolist() == [[8, 9]] * 3  # 3 + max(2, 5)


def test_text_only_is_the_token_index() -> None:
    assert torch.equal(mrope_positions(17, []), torch.arange(17).expand(3, -1))

"""Releases with a vision tower: written by clefserve.testing.release, loaded from ``model.visual.*``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from clefserve.errors import ReleaseError
from clefserve.testing.release import ReleaseSpec, VisionSpec, build_release
from clefserve.vision.preprocess import PreprocessorConfig
from clefserve.vision.weights import load_vision_tower
from tests.oracles import quiet_transformers

SPEC = ReleaseSpec(head=None, head_dim=32, partial_rotary_factor=0.5, vision=VisionSpec())


@torch.inference_mode()
def test_written_release_loads_in_transformers_and_ours(make_release) -> None:
    folder = make_release(SPEC, seed=5)
    quiet_transformers()
    from transformers import Qwen3_5ForConditionalGeneration

    ref, info = Qwen3_5ForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    config = json.loads((folder / "config.json").read_text())
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [3, 3, 2]
    ours = load_vision_tower(folder)
    assert ours is not None
    preprocessor = PreprocessorConfig.from_folder(folder)
    assert preprocessor == SPEC.vision.preprocessor()
    grids = [(1, 6, 4), (1, 2, 10)]
    pixels = torch.randn(44, preprocessor.patch_values, generator=torch.Generator().manual_seed(0))
    expected = ref.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    assert (ours(pixels, grids) - expected).abs().max().item() <= 1e-4


def test_text_only_release_has_no_tower(make_release) -> None:
    assert load_vision_tower(make_release(ReleaseSpec(head=None), seed=1)) is None
    causal_lm = ReleaseSpec(head=None, conditional_generation=False)
    assert load_vision_tower(make_release(causal_lm, seed=1)) is None


def test_incomplete_or_misshaped_tower_is_refused(make_release, tmp_path) -> None:
    source = make_release(SPEC, seed=5)
    tensors = load_file(str(source / "model.safetensors"))
    for name, change in [
        ("missing", lambda t: t.pop("model.visual.merger.linear_fc2.bias")),
        ("shape", lambda t: t.__setitem__("model.visual.pos_embed.weight", torch.zeros(63, 32))),
        ("unexpected", lambda t: t.__setitem__("model.visual.blocks.9.norm1.weight", torch.zeros(32))),
    ]:
        folder = build_release(tmp_path / name, SPEC, seed=5)
        broken = dict(tensors)
        change(broken)
        save_file(broken, str(folder / "model.safetensors"))
        with pytest.raises(ReleaseError, match=r"model\.visual\."):
            load_vision_tower(folder)

"""Loading the vision tower from a release folder's ``model.visual.*`` safetensors tensors.

A release has a vision tower when its ``config.json`` has a ``vision_config`` and its weights hold
``model.visual.*`` tensors. Folders written before images were supported carry a ``vision_config`` without
the tensors: they are text-only (None). A tower that is present must be complete: any missing, unexpected
or mis-shaped tensor is one :class:`ReleaseError` that names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from clefserve.errors import ReleaseError
from clefserve.model.config import BackboneConfig
from clefserve.model.weights import read_tensors, weight_files
from clefserve.vision.config import VisionConfig
from clefserve.vision.tower import VisionTower

PREFIXES = ("model.visual.", "visual.")


def expected_tensors(config: VisionConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        skeleton = VisionTower(config)
    return {name: tuple(p.shape) for name, p in skeleton.named_parameters()}


def _visual_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for file in files:
        for key, tensor in read_tensors(file, lambda key: key.startswith(PREFIXES)):
            prefix = next(p for p in PREFIXES if key.startswith(p))
            found[key[len(prefix):]] = tensor
    return found


def load_vision_tower(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> VisionTower | None:
    """The release's vision tower, or None when the release has none."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    if not raw.get("vision_config"):
        return None
    tensors = _visual_tensors(weight_files(folder))
    if not tensors:  # a vision_config alone (folders written before images) describes no tower
        return None
    config = VisionConfig.from_release_config(raw, BackboneConfig.from_dict(raw).hidden_size)
    assert config is not None
    expected = expected_tensors(config)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name not in expected:
            raise ReleaseError(f"unexpected tensor 'model.visual.{name}' {tuple(tensor.shape)} in the "
                               f"weights of {folder}")
        if tuple(tensor.shape) != expected[name]:
            raise ReleaseError(f"tensor 'model.visual.{name}' has shape {tuple(tensor.shape)}, expected "
                               f"{expected[name]} (from config.json's vision_config)")
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ReleaseError(f"missing tensor 'model.visual.{missing[0]}'{more} in the weights of {folder}")
    with torch.device("meta"):
        tower = VisionTower(config)
    tower.load_state_dict(state, strict=True, assign=True)
    tower.requires_grad_(False)
    return tower.eval()


def check_token_ids(config: VisionConfig, tokenizer_ids: tuple[int | None, int | None, int | None]) -> None:
    """The tokenizer's <|vision_start|>, <|image_pad|>, <|vision_end|> must be the ids config.json names
    (the reference's processor writes the tokenizer's, its model looks for config.json's)."""
    expected = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
    names = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
    for name, want, got in zip(names, expected, tokenizer_ids, strict=True):
        if got != want:
            raise ReleaseError(f"tokenizer.json gives {name} the id {got}, config.json says {want}")

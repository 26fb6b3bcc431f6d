"""A release's image support in one object: the tower behind its encoder cache, and request images in."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from clefserve.errors import ReleaseError
from clefserve.vision.encoder import VisionEncoder
from clefserve.vision.encoder_cache import EncoderCache
from clefserve.vision.inputs import ImageInputs, ImageLimits, PreparedImage
from clefserve.vision.preprocess import PreprocessorConfig
from clefserve.vision.weights import check_token_ids, load_vision_tower

log = logging.getLogger(__name__)


class ReleaseImages:
    """Decodes, preprocesses and encodes the pictures of requests to one release."""

    def __init__(self, inputs: ImageInputs, encoder: VisionEncoder) -> None:
        self.inputs, self.encoder = inputs, encoder

    @classmethod
    def load(
        cls,
        folder: str | Path,
        tokenizer_ids: tuple[int | None, int | None, int | None],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        limits: ImageLimits | None = None,
        cache_bytes: int = 256 << 20,
    ) -> tuple[ReleaseImages | None, str]:
        """The release's image support, or (None, why images are refused)."""
        folder = Path(folder)
        limits = limits or ImageLimits()
        tower = load_vision_tower(folder, dtype, device)
        if tower is None:
            return None, "this model does not take images (its release has no vision tower)"
        preprocessor = PreprocessorConfig.from_folder(folder)
        if preprocessor is None:
            log.warning("%s has a vision tower but no preprocessor_config.json: images are refused", folder)
            return None, "this model's release has no preprocessor_config.json, so images are refused"
        vision = tower.config
        ours = (preprocessor.patch_size, preprocessor.temporal_patch_size, preprocessor.merge_size)
        theirs = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
        if ours != theirs:
            raise ReleaseError(f"preprocessor_config.json patch/temporal patch/merge sizes {ours} differ "
                               f"from config.json's vision_config {theirs}")
        check_token_ids(vision, tokenizer_ids)
        if limits.max_images <= 0:
            return None, "images are turned off on this server (--max-images 0)"
        cache = EncoderCache(cache_bytes) if cache_bytes > 0 else None
        return cls(ImageInputs(preprocessor, limits), VisionEncoder(tower, cache)), ""

    def prepare(self, images: object) -> list[PreparedImage]:
        return self.inputs.prepare(images)

    def embed(self, images: list[PreparedImage] | tuple[PreparedImage, ...],
              use_cache: bool = True) -> list[torch.Tensor]:
        return self.encoder.embed(list(images), use_cache)

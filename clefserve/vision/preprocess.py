"""Qwen's image preprocessing, as a release's ``preprocessor_config.json`` defines it.

An RGB picture is resized (bicubic, Pillow) to the "smart resize" size: each side a multiple of
``patch_size * merge_size``, the pixel count within ``[min_pixels, max_pixels]``, the aspect ratio kept as
closely as possible; then rescaled (x / 255), normalised ((x - mean) / std) and cut into patches of
``channels x temporal_patch_size x patch_size x patch_size`` values (a still picture is repeated
``temporal_patch_size`` times), ordered so that each ``merge_size x merge_size`` block of patches is
contiguous: the order the vision tower's patch merger expects.

This is our own code rather than transformers' ``Qwen2VLImageProcessorPil``, which is the test oracle
(``tests/test_vision_preprocess.py`` checks equal pixel values): transformers is a large test-only
dependency whose image loader fetches URLs and reads files, and the arithmetic is short. The order of
operations and the dtypes (float64 rescale, float32 normalise) follow the oracle, so the values are the
same to the bit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from clefserve.errors import ReleaseError, RequestError

# Qwen2VLImageProcessor's defaults, used for keys a preprocessor_config.json leaves out.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
             3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


@dataclass(frozen=True)
class PreprocessorConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3

    @property
    def factor(self) -> int:
        """Both sides of a resized picture are multiples of this."""
        return self.patch_size * self.merge_size

    @property
    def patch_values(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_folder(cls, folder: str | Path) -> PreprocessorConfig | None:
        """The folder's ``preprocessor_config.json``, or None when it has none."""
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ReleaseError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ReleaseError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "preprocessor_config.json") -> PreprocessorConfig:
        d = cls()
        size = raw.get("size") or {}
        if not isinstance(size, dict):
            raise ReleaseError(f"{where}: size must be an object with shortest_edge/longest_edge")
        # as in the Qwen2-VL processor: min_pixels / max_pixels override size
        min_pixels = raw.get("min_pixels", size.get("shortest_edge", d.min_pixels))
        max_pixels = raw.get("max_pixels", size.get("longest_edge", d.max_pixels))
        if raw.get("do_convert_rgb", True) is not True:
            raise ReleaseError(f"{where}: do_convert_rgb=false is not supported")
        for key in ("do_center_crop", "do_pad"):
            if raw.get(key):
                raise ReleaseError(f"{where}: {key}=true is not supported by Qwen's image processor")
        try:
            config = cls(
                patch_size=int(raw.get("patch_size", d.patch_size)),
                temporal_patch_size=int(raw.get("temporal_patch_size", d.temporal_patch_size)),
                merge_size=int(raw.get("merge_size", d.merge_size)),
                min_pixels=int(min_pixels),
                max_pixels=int(max_pixels),
                image_mean=_triple(raw.get("image_mean", d.image_mean)),
                image_std=_triple(raw.get("image_std", d.image_std)),
                rescale_factor=float(raw.get("rescale_factor", d.rescale_factor)),
                do_resize=bool(raw.get("do_resize", True)),
                do_rescale=bool(raw.get("do_rescale", True)),
                do_normalize=bool(raw.get("do_normalize", True)),
                resample=int(raw.get("resample", d.resample)),
            )
        except (TypeError, ValueError) as exc:
            raise ReleaseError(f"{where}: {exc}") from exc
        config.validate(where)
        return config

    def validate(self, where: str = "preprocessor_config.json") -> None:
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise ReleaseError(f"{where}: patch_size, temporal_patch_size and merge_size must be positive")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ReleaseError(f"{where}: need 0 < min_pixels <= max_pixels, got "
                               f"{self.min_pixels}, {self.max_pixels}")
        if self.resample not in _RESAMPLE:
            raise ReleaseError(f"{where}: unknown resample filter {self.resample}")
        if any(s == 0 for s in self.image_std):
            raise ReleaseError(f"{where}: image_std must not contain 0")

    def to_dict(self) -> dict[str, Any]:
        """A ``preprocessor_config.json`` body (as the test releases write it)."""
        return {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3VLProcessor",
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "rescale_factor": self.rescale_factor,
            "do_resize": self.do_resize,
            "do_rescale": self.do_rescale,
            "do_normalize": self.do_normalize,
            "do_convert_rgb": True,
            "resample": self.resample,
        }


def _triple(value: Any) -> tuple[float, float, float]:
    if isinstance(value, int | float):
        return (float(value),) * 3
    values = tuple(float(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"expected 3 channel values, got {len(values)}")
    return values  # type: ignore[return-value]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) of the resized picture: multiples of ``factor``, pixel count in range, aspect kept.

    Raises ValueError for an aspect ratio above ``MAX_ASPECT_RATIO``, as Qwen's processor does.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"its aspect ratio {max(height, width) / min(height, width):.1f} is above "
                         f"{MAX_ASPECT_RATIO}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class ImagePatches:
    """One picture ready for the vision tower."""

    pixels: np.ndarray  # float32 [grid_h * grid_w, 3 * temporal_patch * patch * patch]
    grid: tuple[int, int, int]  # (t, h, w) in patches; t = 1 for a still picture

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid
        return t * h * w

    def num_tokens(self, merge_size: int) -> int:
        """``<|image_pad|>`` tokens the picture takes in the record (one per merged block of patches)."""
        return self.num_patches // (merge_size * merge_size)


def resized_size(config: PreprocessorConfig, width: int, height: int) -> tuple[int, int]:
    """(height, width) the picture is resized to; raises ValueError for an unusable aspect ratio."""
    if not config.do_resize:
        return height, width
    return smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)


def preprocess(image: Image.Image, config: PreprocessorConfig, field: str = "image") -> ImagePatches:
    """Resize, rescale, normalise and patchify one RGB picture; refuse one whose size cannot be used."""
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB picture, got mode {image.mode}")
    width, height = image.size
    try:
        new_h, new_w = resized_size(config, width, height)
    except ValueError as exc:
        raise RequestError(f"{field}: {exc}", error_type="invalid_image") from None
    factor = config.factor
    if new_h % factor or new_w % factor:  # only without do_resize
        raise RequestError(f"{field}: {width}x{height} is not a multiple of {factor} pixels per side",
                           error_type="invalid_image")
    if config.do_resize:
        image = image.resize((new_w, new_h), resample=_RESAMPLE[config.resample])
    values: np.ndarray = np.asarray(image)  # uint8 [H, W, 3]
    if config.do_rescale:
        values = (values.astype(np.float64) * config.rescale_factor).astype(np.float32)
    else:
        values = values.astype(np.float32)
    if config.do_normalize:
        mean = np.array(config.image_mean, dtype=np.float32)
        std = np.array(config.image_std, dtype=np.float32)
        values = (values - mean) / std
    grid = (1, new_h // config.patch_size, new_w // config.patch_size)
    return ImagePatches(_patchify(values, config), grid)


def _patchify(values: np.ndarray, config: PreprocessorConfig) -> np.ndarray:
    """[H, W, C] -> [patches, C * T * P * P], merge blocks contiguous, the frame repeated T times."""
    height, width, channels = values.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    blocks = values.reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
    # -> (block row, block col, row in block, col in block, channel, pixel row, pixel col)
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return np.ascontiguousarray(frames).reshape(grid_h * grid_w, channels * t * p * p)

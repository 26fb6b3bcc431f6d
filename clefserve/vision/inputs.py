"""A request's ``images`` -> pictures ready for the record and the tower (decoded, preprocessed, bounded)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from clefserve.errors import RequestError
from clefserve.vision.decode import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, decode_image
from clefserve.vision.preprocess import ImagePatches, PreprocessorConfig, preprocess

DEFAULT_MAX_IMAGES = 4
# Pictures decoded at once, whatever the number of requests: a 40 MP picture takes ~0.4 GB while it is
# decoded, turned upright and converted, so this bounds that memory (the tower has its own lock).
DECODE_CONCURRENCY = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class PreparedImage:
    digest: str  # of the decoded RGB pixels: what the encoder cache and the prefix cache key on
    patches: ImagePatches
    merge_size: int  # patches per side of one <|image_pad|> token

    @property
    def num_tokens(self) -> int:
        """<|image_pad|> tokens the picture takes in the record."""
        return self.patches.num_tokens(self.merge_size)


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = DEFAULT_MAX_IMAGES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # declared pixels of one decoded picture
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # one picture's file size


def check_image_list(images: Any, max_images: int) -> list[Any]:
    """The request's ``images`` as a list (None and [] are no images), refused unless a short list."""
    if images is None:
        return []
    if not isinstance(images, list):
        raise RequestError("images: must be a list of base64 strings or data:image/...;base64, URLs",
                           error_type="invalid_image")
    if len(images) > max_images:
        raise RequestError(f"images: at most {max_images} images per request (--max-images), got "
                           f"{len(images)}", error_type="invalid_image")
    return images


class ImageInputs:
    def __init__(self, preprocessor: PreprocessorConfig, limits: ImageLimits | None = None) -> None:
        self.preprocessor = preprocessor
        self.limits = limits or ImageLimits()
        self._decoding = threading.BoundedSemaphore(DECODE_CONCURRENCY)

    def prepare(self, images: Any) -> list[PreparedImage]:
        """Decode and preprocess every entry; the first bad one raises a RequestError naming it."""
        limits = self.limits
        entries = check_image_list(images, limits.max_images)
        prepared = []
        for index, entry in enumerate(entries):
            with self._decoding:
                decoded = decode_image(entry, index, limits.max_pixels, limits.max_bytes)
                patches = preprocess(decoded.image, self.preprocessor, f"images[{index}]")
            prepared.append(PreparedImage(decoded.digest, patches, self.preprocessor.merge_size))
        return prepared

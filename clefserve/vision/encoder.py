"""Pictures -> the rows that replace their ``<|image_pad|>`` embeddings: the tower behind an encoder cache.

Called from request threads (never the event loop). One picture is encoded at a time: the tower's memory
grows with the square of a picture's patches, and each picture is encoded on its own so that its rows
never depend on what else is in flight (batch invariance).
"""

from __future__ import annotations

import threading
import time

import torch

from clefserve.vision.encoder_cache import EncoderCache
from clefserve.vision.inputs import PreparedImage
from clefserve.vision.tower import VisionTower


class VisionEncoder:
    def __init__(self, tower: VisionTower, cache: EncoderCache | None = None) -> None:
        self.tower = tower
        self.cache = cache
        self._lock = threading.Lock()
        self.counts = {"images_encoded": 0, "patches_encoded": 0}
        self.seconds = 0.0

    @torch.inference_mode()
    def embed(self, images: list[PreparedImage], use_cache: bool = True) -> list[torch.Tensor]:
        """One ``[num_tokens, text hidden]`` tensor per picture, on the tower's device and dtype."""
        cache = self.cache if use_cache else None
        out = []
        for image in images:
            rows = cache.get(image.digest) if cache is not None else None
            if rows is None:
                rows = self._encode(image)
                if cache is not None:
                    cache.put(image.digest, rows)
            out.append(rows)
        return out

    def _encode(self, image: PreparedImage) -> torch.Tensor:
        pixels = torch.from_numpy(image.patches.pixels)
        with self._lock:
            started = time.perf_counter()
            rows = self.tower.encode(pixels, image.patches.grid)
            if rows.device.type == "cuda":
                torch.cuda.synchronize(rows.device)
            self.seconds += time.perf_counter() - started
            self.counts["images_encoded"] += 1
            self.counts["patches_encoded"] += image.patches.num_patches
        if rows.shape[0] != image.num_tokens:
            raise RuntimeError(f"the vision tower gave {rows.shape[0]} rows for {image.num_tokens} tokens")
        return rows

    def stats(self) -> dict[str, float]:
        cache = self.cache.stats() if self.cache is not None else {}
        return {**self.counts, "vision_seconds": self.seconds, **cache}

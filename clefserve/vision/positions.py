"""Multimodal rotary positions (Qwen's M-RoPE): three position rows, time, height and width, per token.

A text token has the same position in all three rows, one more than the token before it. The tokens of a
picture (one per merged block of patches, row by row) share the picture's start position in the time row
and count rows and columns from it in the height and width rows. Text after a picture continues from the
picture's start plus its larger merged side, so a position no longer equals the token's index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageSpan:
    """Where a picture's ``<|image_pad|>`` tokens sit in a record, and its patch grid."""

    start: int
    grid: tuple[int, int, int]  # (t, h, w) in patches
    merge_size: int

    @property
    def merged_grid(self) -> tuple[int, int, int]:
        t, h, w = self.grid
        return t, h // self.merge_size, w // self.merge_size

    @property
    def length(self) -> int:
        t, h, w = self.merged_grid
        return t * h * w

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def extent(self) -> int:
        """How far the text after the picture moves on: its larger merged side."""
        _, h, w = self.merged_grid
        return max(h, w)


def mrope_positions(length: int, images: Sequence[ImageSpan]) -> torch.Tensor:
    """``[3, length]`` int64 positions of a record of ``length`` tokens holding ``images`` (in order)."""
    out = torch.empty(3, length, dtype=torch.long)
    index = 0  # next token
    position = 0  # its position, were it text
    for image in sorted(images, key=lambda span: span.start):
        if image.start < index or image.end > length:
            raise ValueError(f"image span [{image.start}, {image.end}) overlaps another or leaves the record")
        text = image.start - index
        out[:, index:image.start] = torch.arange(position, position + text)
        position += text
        t, h, w = image.merged_grid
        out[0, image.start:image.end] = position + torch.arange(t).repeat_interleave(h * w)
        out[1, image.start:image.end] = position + torch.arange(h).repeat_interleave(w).repeat(t)
        out[2, image.start:image.end] = position + torch.arange(w).repeat(t * h)
        position += image.extent
        index = image.end
    out[:, index:] = torch.arange(position, position + length - index)
    return out

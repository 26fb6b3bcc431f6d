"""What a sequence may carry beyond its token ids: rows that replace token embeddings, and M-RoPE positions.

A picture's ``<|image_pad|>`` tokens all have one id; their input rows come from the vision tower instead
of the embedding table, and their rotary positions count rows and columns of the picture (three position
rows: time, height, width). Any piece of the sequence can be run on its own: ``embeds_for`` and
``positions_for`` cut both to the positions ``[start, end)``, also through the middle of a picture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceInputs:
    # (first position, rows [n, hidden]): the input rows of positions first .. first + n - 1
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()
    positions: torch.Tensor | None = None  # [3, length] int64; None: every row is the token index

    def embeds_for(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """(offset from ``start``, rows) of the replaced positions within ``[start, end)``."""
        out = []
        for first, rows in self.embeds:
            lo, hi = max(start, first), min(end, first + rows.shape[0])
            if lo < hi:
                out.append((lo - start, rows[lo - first : hi - first]))
        return out

    def positions_for(self, start: int, end: int) -> torch.Tensor:
        """``[3, end - start]`` positions of the piece."""
        if self.positions is None:
            return torch.arange(start, end).expand(3, -1)
        return self.positions[:, start:end]


# Computes a sequence's inputs when the engine admits it, given the first position it will run (earlier
# positions come from the prefix cache, so their rows are not needed): the vision tower then runs on the
# engine's thread, only for admitted sequences, and not at all for pictures the cache already covers.
InputsProvider = Callable[[int], SequenceInputs | None]

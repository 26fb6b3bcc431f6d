"""A :class:`~clefserve.model.cache.ForwardCache` over the KV pool and the GDN state pool, for one step.

The per-sequence index tensors are built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clefserve.engine.kv_pool import KVPool
from clefserve.engine.state_pool import StatePool


@dataclass(frozen=True)
class SeqSlots:
    """Where one sequence of the step lives in the pools."""

    past: int
    total: int  # past + new tokens
    write_rows: torch.Tensor  # pool rows (block * block_size + offset) of the new tokens [T]
    blocks: torch.Tensor  # the blocks holding positions 0 .. total-1
    first_row: int | None  # when those blocks are adjacent: the pool row of position 0
    slot: int  # GDN state slot


def seq_slots(
    past: int, new: int, block_table: torch.Tensor, block_size: int, slot: int, first_block: int | None
) -> SeqSlots:
    """``first_block``: the block table is the run ``first_block, first_block + 1, ...``, or None."""
    positions = torch.arange(past, past + new, device=block_table.device)
    rows = block_table[positions // block_size] * block_size + positions % block_size
    used = -(-(past + new) // block_size)
    first_row = None if first_block is None else first_block * block_size
    return SeqSlots(past, past + new, rows, block_table[:used], first_row, slot)


class PagedCache:
    def __init__(
        self,
        kv: KVPool,
        states: StatePool,
        attention_index: dict[int, int],
        gdn_index: dict[int, int],
        seqs: list[SeqSlots],
    ) -> None:
        self.kv, self.states = kv, states
        self.attention_index, self.gdn_index = attention_index, gdn_index
        self.seqs = seqs
        # states inside a sequence's new tokens (Batch.captures): seq -> GDN index -> (conv, recurrent)
        self.kept: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def attention_kv(
        self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seqs[seq]
        index = self.attention_index[layer]
        k_rows, v_rows = self.kv.token_rows(index)
        k, v = k.to(self.kv.dtype), v.to(self.kv.dtype)
        k_rows.index_copy_(0, s.write_rows, k)
        v_rows.index_copy_(0, s.write_rows, v)
        if s.past == 0:
            return k, v
        if s.first_row is not None:  # adjacent blocks: read the positions in place
            return k_rows[s.first_row : s.first_row + s.total], v_rows[s.first_row : s.first_row + s.total]
        shape = (-1, self.kv.kv_heads, self.kv.head_dim)
        # whole blocks are copied, but only the first `total` rows are handed on: the tail of the last
        # block may be free memory (garbage, even NaN) and must never reach the attention math
        all_k = self.kv.k[index].index_select(0, s.blocks).view(shape)[: s.total]
        all_v = self.kv.v[index].index_select(0, s.blocks).view(shape)[: s.total]
        return all_k, all_v

    def linear_states(self, layer: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        index = self.gdn_index[layer]
        conv: list[torch.Tensor | None] = []
        recurrent: list[torch.Tensor | None] = []
        for s in self.seqs:
            fresh = s.past == 0  # a fresh slot holds garbage (even NaN): never read it
            conv.append(None if fresh else self.states.conv[s.slot, index])
            recurrent.append(None if fresh else self.states.recurrent[s.slot, index])
        return conv, recurrent

    def store_linear_states(self, layer: int, conv: list[torch.Tensor], recurrent: torch.Tensor) -> None:
        index = self.gdn_index[layer]
        for s, c, r in zip(self.seqs, conv, recurrent, strict=True):
            self.states.conv[s.slot, index].copy_(c)
            self.states.recurrent[s.slot, index].copy_(r)

    def keep_linear_states(self, layer: int, seq: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.kept.setdefault(seq, {})[self.gdn_index[layer]] = (conv, recurrent)

    def kept_states(self, seq: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A sequence's kept states stacked like a state-pool slot (``[gdn_layers, ...]``), or None."""
        if not self.gdn_index:  # no GDN layer: nothing to keep (empty like the slot)
            slot = self.seqs[seq].slot
            return self.states.conv[slot].clone(), self.states.recurrent[slot].clone()
        kept = self.kept.get(seq)
        if kept is None or len(kept) != len(self.gdn_index):
            return None
        layers = range(len(self.gdn_index))
        return torch.stack([kept[i][0] for i in layers]), torch.stack([kept[i][1] for i in layers])

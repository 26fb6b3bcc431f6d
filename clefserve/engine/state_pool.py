"""The Gated DeltaNet state pool: one slot per running sequence, holding every GDN layer's state.

conv ``[slots, gdn_layers, kernel-1, conv_dim]`` in the model dtype (the last inputs of the causal conv,
channel-last like ``clefserve.model.ops.conv``)
and recurrent ``[slots, gdn_layers, HV, K, V]`` in fp32 (the delta-rule memory).
"""

from __future__ import annotations

import torch


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("GDN state pool exhausted")
        slot = self._free.pop()
        self._used[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not self._used[slot]:
            raise RuntimeError(f"GDN slot {slot} freed twice")
        self._used[slot] = False
        self._free.append(slot)


class StatePool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        conv_dim: int,
        conv_kernel: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # contents of a fresh slot are never read: a GDN layer starts from zeros when past_len == 0
        self.conv = torch.empty(num_slots, num_layers, conv_kernel - 1, conv_dim, dtype=dtype, device=device)
        self.recurrent = torch.empty(
            num_slots, num_layers, value_heads, key_dim, value_dim, dtype=torch.float32, device=device
        )
        self.allocator = SlotAllocator(num_slots)

    def fill_slots(self, slots: list[int], value: float) -> None:
        if slots:
            index = torch.tensor(slots, dtype=torch.long, device=self.conv.device)
            self.conv.index_fill_(0, index, value)
            self.recurrent.index_fill_(0, index, value)

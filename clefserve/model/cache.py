"""How the backbone reads and writes per-sequence state during one forward.

A forward runs the new tokens of one or more sequences. Attention layers hand over the K/V of the new
tokens and get back the K/V of every position of that sequence; Gated DeltaNet layers read the conv and
recurrent state at the sequence's current end and store the state after the new tokens. The engine
implements this over its paged KV pool and GDN slot pool; :class:`DenseCache` keeps plain tensors per
sequence (reference path, tests, tools).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class ForwardCache(Protocol):
    def attention_kv(
        self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [T, Hkv, D]`` of the new tokens; return K/V of all positions ``[past+T, Hkv, D]``."""
        ...

    def linear_states(self, layer: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Each sequence's conv state ``[kernel-1, C]`` and fp32 recurrent state ``[HV, K, V]``; None for a
        sequence that starts in this forward."""
        ...

    def store_linear_states(self, layer: int, conv: list[torch.Tensor], recurrent: torch.Tensor) -> None:
        """The states after the new tokens: conv per sequence, recurrent ``[B, HV, K, V]``."""
        ...

    def keep_linear_states(self, layer: int, seq: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """The states of sequence ``seq`` inside its new tokens, where ``Batch.captures`` asked for them."""
        ...


@dataclass
class SequenceState:
    """Everything needed to continue one sequence: K/V per attention layer and GDN state per linear layer."""

    length: int = 0
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)

    def clone(self) -> SequenceState:
        return SequenceState(
            length=self.length,
            kv={i: (k.clone(), v.clone()) for i, (k, v) in self.kv.items()},
            conv={i: c.clone() for i, c in self.conv.items()},
            recurrent={i: r.clone() for i, r in self.recurrent.items()},
        )


class DenseCache:
    """A :class:`ForwardCache` over one :class:`SequenceState` per sequence of the forward."""

    def __init__(self, states: list[SequenceState]) -> None:
        self.states = states
        self.kept: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # seq -> layer -> states

    def attention_kv(
        self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.states[seq]
        if layer in state.kv:
            old_k, old_v = state.kv[layer]
            k, v = torch.cat((old_k, k)), torch.cat((old_v, v))
        state.kv[layer] = (k, v)
        return k, v

    def linear_states(self, layer: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        return ([state.conv.get(layer) for state in self.states],
                [state.recurrent.get(layer) for state in self.states])

    def store_linear_states(self, layer: int, conv: list[torch.Tensor], recurrent: torch.Tensor) -> None:
        for state, c, r in zip(self.states, conv, recurrent, strict=True):
            state.conv[layer] = c
            state.recurrent[layer] = r

    def keep_linear_states(self, layer: int, seq: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.kept.setdefault(seq, {})[layer] = (conv, recurrent)

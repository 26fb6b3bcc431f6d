"""The Qwen3.5 hybrid decoder stack: embeddings, 3:1 Gated DeltaNet / gated attention layers, final norm."""

from __future__ import annotations

import torch
from torch import nn

from clefserve.model.cache import DenseCache, ForwardCache, SequenceState
from clefserve.model.config import BackboneConfig
from clefserve.model.layers import Batch, DecoderLayer, Linear, RMSNorm
from clefserve.model.ops import Ops, reference_ops


class Backbone(nn.Module):
    def __init__(self, config: BackboneConfig, ops: Ops | None = None) -> None:
        super().__init__()
        self.config = config
        self.ops = ops or reference_ops()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.ops) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.ops)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        # bytes of weights still backed by the safetensors files (CPU): the page cache holds them, and the OS
        # counts that as free memory, so the memory planner counts them as used (set by the loader)
        self.file_mapped_bytes = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights (a tied output matrix counted once)."""
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.parameters()}
        return sum(storages.values())

    def set_ops(self, ops: Ops) -> None:
        """Swap the kernel table everywhere (reference vs fast path) without touching the weights."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def forward(self, input_ids: torch.Tensor, batch: Batch, cache: ForwardCache) -> torch.Tensor:
        """Run the new tokens ``input_ids [N]`` of the batch's sequences; return final-norm hidden rows.

        The caller's ``cache`` supplies and receives each sequence's state (see ``clefserve.model.cache``).
        """
        x = self.embed_tokens(input_ids)
        positions = batch.positions(input_ids.device)
        rope = self.ops.rope_tables(positions, self.config.rotary_dim, self.config.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, batch, rope, cache)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def run_sequence(
        self, input_ids: torch.Tensor, state: SequenceState | None = None
    ) -> tuple[torch.Tensor, SequenceState]:
        """Continue one sequence from ``state`` (a fresh one when None) by ``input_ids [T]``.

        Returns the hidden rows of the new tokens and the sequence's state after them (updated in place).
        """
        state = state if state is not None else SequenceState()
        batch = Batch(seq_lens=(int(input_ids.shape[0]),), past_lens=(state.length,))
        hidden = self.forward(input_ids.to(self.device), batch, DenseCache([state]))
        state.length += int(input_ids.shape[0])
        return hidden, state

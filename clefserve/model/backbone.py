"""The Qwen3.5 hybrid decoder stack: embeddings, 3:1 Gated DeltaNet / gated attention layers, final norm."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from clefserve.model.cache import DenseCache, ForwardCache, SequenceState
from clefserve.model.config import BackboneConfig
from clefserve.model.inputs import SequenceInputs
from clefserve.model.layers import Batch, DecoderLayer, Embedding, Linear, RMSNorm
from clefserve.model.ops import Ops, reference_ops
from clefserve.model.ops.rope import mrope_tables

# (first row in the step's flat rows, rows): input rows that replace the token embeddings there
Embeds = list[tuple[int, torch.Tensor]]


class Backbone(nn.Module):
    def __init__(self, config: BackboneConfig, ops: Ops | None = None) -> None:
        super().__init__()
        self.config = config
        self.ops = ops or reference_ops()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
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

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: Batch,
        cache: ForwardCache,
        embeds: Embeds | None = None,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Run the new tokens ``input_ids [N]`` of the batch's sequences; return final-norm hidden rows.

        The caller's ``cache`` supplies and receives each sequence's state (see ``clefserve.model.cache``);
        ``embeds`` replace the embeddings of some rows (pictures), ``batch.mrope`` gives their positions.
        ``between_layers`` is called at every boundary inside the step: after each layer's token mixer and
        after each layer but the last (the engine runs short records there); it may run other forwards, on
        other sequences' state.
        """
        x = self.embed_tokens(input_ids)
        for row, values in embeds or ():
            x[row : row + values.shape[0]] = values.to(device=x.device, dtype=x.dtype)
        rope = self._rope(batch, input_ids.device, x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, rope, cache, between_layers)
            if between_layers is not None and i < last:
                between_layers()
        return self.norm(x)

    def _rope(
        self, batch: Batch, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.config
        if batch.mrope is None or all(p is None for p in batch.mrope):
            return self.ops.rope_tables(batch.positions(device), config.rotary_dim, config.rope_theta, dtype)
        # sequence by sequence, so a text sequence's tables never depend on what it is batched with
        tables = []
        for (n, past), positions in zip(zip(batch.seq_lens, batch.past_lens, strict=True), batch.mrope,
                                        strict=True):
            if positions is None:
                tables.append(self.ops.rope_tables(torch.arange(past, past + n, device=device),
                                                   config.rotary_dim, config.rope_theta, dtype))
            else:
                tables.append(mrope_tables(positions.to(device), config.rotary_dim, config.rope_theta,
                                           config.mrope_section, dtype))
        return torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def run_sequence(
        self,
        input_ids: torch.Tensor,
        state: SequenceState | None = None,
        inputs: SequenceInputs | None = None,
    ) -> tuple[torch.Tensor, SequenceState]:
        """Continue one sequence from ``state`` (a fresh one when None) by ``input_ids [T]``.

        ``inputs``: picture rows and M-RoPE positions of the whole sequence (the piece run here is cut
        from them). Returns the hidden rows of the new tokens and the sequence's state after them
        (updated in place).
        """
        state = state if state is not None else SequenceState()
        start, n = state.length, int(input_ids.shape[0])
        mrope = None
        embeds = None
        if inputs is not None:
            mrope = (inputs.positions_for(start, start + n),) if inputs.positions is not None else None
            embeds = inputs.embeds_for(start, start + n)
        batch = Batch(seq_lens=(n,), past_lens=(start,), mrope=mrope)
        hidden = self.forward(input_ids.to(self.device), batch, DenseCache([state]), embeds)
        state.length += n
        return hidden, state

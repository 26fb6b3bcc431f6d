"""Runs one engine step: the scheduled chunks of several sequences as one variable-length forward."""

from __future__ import annotations

from collections.abc import Callable

import torch

from clefserve.engine.kv_pool import KVPool
from clefserve.engine.paged_cache import PagedCache, seq_slots
from clefserve.engine.sequence import Sequence
from clefserve.engine.state_pool import StatePool
from clefserve.model.backbone import Backbone
from clefserve.model.inputs import SequenceInputs
from clefserve.model.layers import Batch


class ModelRunner:
    def __init__(self, model: Backbone, kv: KVPool, states: StatePool) -> None:
        self.model, self.kv, self.states = model, kv, states
        config = model.config
        self.attention_index = {layer: i for i, layer in enumerate(config.full_layers)}
        self.gdn_index = {layer: i for i, layer in enumerate(config.linear_layers)}
        self.device = model.device

    def prepare(self, seq: Sequence) -> None:
        """Per-sequence device tensors, made once at admission; a sequence resumed from the prefix cache
        gets the cached hidden rows, GDN state and the K/V of its cut block copied in. Inputs given as a
        provider are computed here, from the first position that will run (the vision tower, for pictures
        the prefix cache did not cover)."""
        if callable(seq.inputs):
            seq.inputs = seq.inputs(seq.num_computed)
        seq.block_table_tensor = torch.tensor(seq.block_table, dtype=torch.long, device=self.device)
        if seq.block_table:
            self.kv.make_resident(max(seq.block_table) + 1)
        table = seq.block_table
        adjacent = bool(table) and table[-1] - table[0] == len(table) - 1 and table == sorted(table)
        seq.first_block = table[0] if adjacent else None
        if seq.keep_hidden:
            shape = (seq.num_prompt_tokens, self.model.config.hidden_size)
            seq.hidden = torch.empty(shape, dtype=self.model.dtype, device=self.device)
        resume = seq.prefix.resume if seq.prefix is not None else None
        if resume is None:
            return
        seq.prefix.resume = None  # the copies below are all the sequence needs from the cache
        if seq.hidden is not None and resume.hidden is not None:
            start = 0
            for rows in resume.hidden:
                seq.hidden[start : start + rows.shape[0]].copy_(rows)
                start += rows.shape[0]
            assert start == resume.position
        if resume.conv is not None and resume.recurrent is not None:
            assert seq.slot is not None
            self.states.conv[seq.slot].copy_(resume.conv)
            self.states.recurrent[seq.slot].copy_(resume.recurrent)
        cut, tail = divmod(resume.position, self.kv.block_size)
        if tail and resume.tail_k is not None and resume.tail_v is not None:
            block = seq.block_table[cut]  # a fresh block: the sequence writes its positions >= P into it
            self.kv.k[:, block, :tail].copy_(resume.tail_k)
            self.kv.v[:, block, :tail].copy_(resume.tail_v)

    @torch.inference_mode()
    def run(self, chunks: list[tuple[Sequence, int]],
            between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """Run ``num_tokens`` new tokens of each ``(sequence, num_tokens)``; returns the hidden rows [N, H].

        Keeps the rows of sequences that asked for them; does not advance ``num_computed``.
        ``between_layers``: see :meth:`Backbone.forward`.
        """
        past = [seq.num_computed for seq, _ in chunks]
        ids = torch.cat([seq.token_ids[p : p + n] for (seq, n), p in zip(chunks, past, strict=True)])
        mrope = None
        inputs = [seq.inputs if isinstance(seq.inputs, SequenceInputs) else None for seq, _ in chunks]
        if any(i is not None and i.positions is not None for i in inputs):
            mrope = tuple(
                i.positions_for(p, p + n) if i is not None and i.positions is not None else None
                for i, (_, n), p in zip(inputs, chunks, past, strict=True)
            )
        embeds, row = [], 0
        for i, (_, n), p in zip(inputs, chunks, past, strict=True):  # picture rows, also of part of one
            if i is not None:
                embeds.extend((row + offset, rows) for offset, rows in i.embeds_for(p, p + n))
            row += n
        captures = tuple(seq.capture_at for seq, _ in chunks)
        batch = Batch(seq_lens=tuple(n for _, n in chunks), past_lens=tuple(past), mrope=mrope,
                      captures=captures if any(captures) else ())
        slots = []
        for (seq, n), p in zip(chunks, past, strict=True):
            assert seq.block_table_tensor is not None and seq.slot is not None
            slots.append(
                seq_slots(p, n, seq.block_table_tensor, self.kv.block_size, seq.slot, seq.first_block)
            )
        cache = PagedCache(self.kv, self.states, self.attention_index, self.gdn_index, slots)
        hidden = self.model(ids.to(self.device, non_blocking=True), batch, cache, embeds, between_layers)
        for i, (seq, _) in enumerate(chunks):
            seq.captured = cache.kept_states(i) if seq.capture_at else None
        start = 0
        for (seq, n), p in zip(chunks, past, strict=True):
            if seq.hidden is not None and p + n <= seq.hidden.shape[0]:
                seq.hidden[p : p + n].copy_(hidden[start : start + n])
            start += n
        return hidden

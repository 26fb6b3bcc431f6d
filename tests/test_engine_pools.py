"""Block and slot allocators; the paged cache carrying a sequence through prefill chunks and decode steps."""

from __future__ import annotations

import pytest
import torch

from clefserve.engine.kv_pool import BlockAllocator, KVPool
from clefserve.engine.runner import ModelRunner
from clefserve.engine.sequence import Sequence
from clefserve.engine.state_pool import SlotAllocator, StatePool
from clefserve.model.weights import load_backbone
from tests.engine_support import ENGINE_SPECS


def test_block_allocator_counts_references():
    blocks = BlockAllocator(4)
    a = blocks.allocate(3)
    assert blocks.num_free == 1 and not blocks.can_allocate(2)
    blocks.share(a[0])
    blocks.free(a)
    assert blocks.num_free == 3  # a[0] still has an owner
    blocks.free([a[0]])
    assert blocks.num_free == 4
    with pytest.raises(RuntimeError):
        blocks.free([a[1]])
    with pytest.raises(RuntimeError):
        blocks.allocate(5)


def test_block_allocator_prefers_adjacent_blocks():
    blocks = BlockAllocator(10)
    a, b, c = blocks.allocate(3), blocks.allocate(3), blocks.allocate(2)
    assert (a, b, c) == ([0, 1, 2], [3, 4, 5], [6, 7])
    blocks.free(a)
    blocks.free(c)  # free: 0 1 2 6 7 8 9
    assert blocks.allocate(4) == [6, 7, 8, 9]
    assert blocks.allocate(2) == [0, 1]
    blocks.free([4])  # free: 2 4
    assert blocks.allocate(2) == [2, 4]  # no run of two left: the lowest free blocks
    assert blocks.num_free == 0 and blocks.free_ids() == []


def test_slot_allocator():
    slots = SlotAllocator(2)
    s0, s1 = slots.allocate(), slots.allocate()
    assert {s0, s1} == {0, 1} and slots.num_free == 0
    with pytest.raises(RuntimeError):
        slots.allocate()
    slots.free(s0)
    with pytest.raises(RuntimeError):
        slots.free(s0)
    assert slots.allocate() == s0


@pytest.mark.parametrize("adjacent", [True, False])
@torch.inference_mode()
def test_paged_cache_through_chunks_and_decode_steps(make_release, adjacent):
    model = load_backbone(make_release(ENGINE_SPECS["two-attn"], seed=7))
    mc = model.config
    kv = KVPool(len(mc.full_layers), 32, 4, mc.num_key_value_heads, mc.head_dim, model.dtype, model.device)
    states = StatePool(2, len(mc.linear_layers), mc.conv_dim, mc.linear_conv_kernel_dim,
                       mc.linear_num_value_heads, mc.linear_key_head_dim, mc.linear_value_head_dim,
                       model.dtype, model.device)
    kv.fill_blocks(list(range(32)), float("nan"))
    states.fill_slots([0, 1], float("nan"))
    runner = ModelRunner(model, kv, states)
    ids = torch.randint(0, mc.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    want, _ = model.run_sequence(ids)

    seq = Sequence(ids[:21])
    need = kv.blocks_for(30)  # room for the decoded tokens too
    if adjacent:
        seq.block_table = kv.allocator.allocate(need)
    else:  # every other block, in falling order: K/V must be gathered through the table
        taken = kv.allocator.allocate(2 * need)
        seq.block_table = taken[::-2]
        kv.allocator.free(taken[-2::-2])
    seq.slot = states.allocator.allocate()
    runner.prepare(seq)
    assert (seq.first_block is not None) == adjacent
    rows = []
    for n in (7, 1, 13):  # prefill chunks
        rows.append(runner.run([(seq, n)]))
        seq.num_computed += n
    assert (seq.hidden - want[:21]).abs().max().item() <= 1e-5
    for t in ids[21:].tolist():  # decode: one appended token per step
        seq.append_token(t)
        rows.append(runner.run([(seq, 1)]))
        seq.num_computed += 1
    got = torch.cat(rows)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5

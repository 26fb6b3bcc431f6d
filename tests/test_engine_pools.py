"""Block and slot allocators; the paged cache carrying a sequence through prefill chunks and decode steps."""

from __future__ import annotations

import threading

import pytest
import torch

from clefserve.engine import Engine, kv_pool
from clefserve.engine import engine as engine_module
from clefserve.engine.kv_pool import BlockAllocator, KVPool
from clefserve.engine.runner import ModelRunner
from clefserve.engine.sequence import Sequence
from clefserve.engine.state_pool import SlotAllocator, StatePool
from clefserve.model.weights import load_backbone
from tests.engine_support import ENGINE_SPECS, keep_hidden, small_config


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


def test_kv_pool_faults_in_untouched_blocks_ahead_and_never_rewrites_touched_ones():
    kv = KVPool(2, 40, 4, 1, 8, torch.float32, torch.device("cpu"))
    kv._resident_step = 8  # blocks per bulk fault-in (64 MiB in production)
    assert kv.resident_blocks == 0
    kv.k[:, :40] = 5.0  # stand-in for a pool whose pages hold data: only never-touched blocks are zeroed
    kv.make_resident(3)
    assert kv.resident_blocks == 8 and bool((kv.k[:, :8] == 0).all()) and bool((kv.k[:, 8:] == 5).all())
    kv.k[:, :8] = 7.0  # blocks in use
    kv.make_resident(8)  # already resident: nothing is written
    assert bool((kv.k[:, :8] == 7).all())
    kv.make_resident(21)  # past the step: up to the asked block
    assert kv.resident_blocks == 21 and bool((kv.k[:, 8:21] == 0).all()) and bool((kv.k[:, :8] == 7).all())
    kv.make_resident(100)
    assert kv.resident_blocks == 40
    poisoned = KVPool(2, 40, 4, 1, 8, torch.float32, torch.device("cpu"))
    poisoned.fill_blocks([3, 30], float("nan"))  # a test's garbage in free blocks must stay garbage
    poisoned.make_resident(31)
    assert bool(poisoned.k[:, 30].isnan().all()) and bool(poisoned.v[:, 3].isnan().all())


def test_an_engine_on_the_cpu_faults_in_the_blocks_a_full_batch_and_the_prefix_cache_can_hold(
    make_release, monkeypatch
):
    model = load_backbone(make_release(ENGINE_SPECS["two-attn"], seed=7))
    config = small_config(kv_cache_mb=64, max_length=40, prefix_cache_mb=1)
    monkeypatch.setattr(kv_pool, "RESIDENT_STEP_BYTES", 1)  # exactly the blocks asked for
    with Engine(model, config, keep_hidden) as engine:
        kv = engine.kv
        bound = engine.pools.prefix_cache_bytes // kv.block_bytes + config.max_num_seqs * kv.blocks_for(40)
        assert 0 < bound < kv.num_blocks
        assert kv.resident_blocks == bound
        ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
        engine.submit(ids).result()
        assert kv.resident_blocks == bound  # serving stayed inside the faulted-in blocks


@pytest.mark.parametrize(("prefix_cache", "kv_cache_mb", "bound"),
                         [(True, 64, "budget"), (True, 1, "pool"), (False, 64, None)])
def test_the_engine_thread_grows_its_heap_by_what_the_prefix_cache_can_hold_before_serving(
    make_release, monkeypatch, prefix_cache, kv_cache_mb, bound
):
    calls = []
    monkeypatch.setattr(engine_module, "prefault_heap",
                        lambda nbytes: calls.append((threading.current_thread().name, nbytes)) or nbytes)
    model = load_backbone(make_release(ENGINE_SPECS["two-attn"], seed=7))
    config = small_config(kv_cache_mb=kv_cache_mb, max_length=40, prefix_cache_mb=2,
                          prefix_cache=prefix_cache)
    with Engine(model, config, keep_hidden) as engine:
        engine.submit(torch.arange(12)).result()
        budget, pool = engine.pools.prefix_cache_bytes, engine.pools.kv_bytes
    # on the thread whose heap the cache's snapshots and hidden rows come from: its budget, or the KV pool's
    # size where that is smaller; nothing without a cache
    if bound is None:
        assert calls == []
    else:
        assert calls == [("engine", budget if bound == "budget" else pool)]
        assert (budget < pool) == (bound == "budget")


def test_an_engine_whose_heap_cannot_grow_still_serves(make_release, monkeypatch, caplog):
    def no_memory(nbytes: int) -> int:
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(engine_module, "prefault_heap", no_memory)
    model = load_backbone(make_release(ENGINE_SPECS["two-attn"], seed=7))
    with Engine(model, small_config(kv_cache_mb=64, max_length=40), keep_hidden) as engine:
        hidden = engine.submit(torch.arange(12)).result(timeout=120)
    assert hidden.shape[0] == 12
    assert "could not grow the engine thread's heap" in caplog.text

"""Pool sizing from the flags, and the requests refused at once: too long, queue full, malformed."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from clefserve.engine import Engine, QueueFullError, plan_pools
from clefserve.engine.memory import available_memory, gdn_bytes_per_slot, kv_bytes_per_block
from clefserve.errors import RequestError
from clefserve.model.weights import load_backbone
from tests.engine_support import ENGINE_SPECS, PausingFinish, small_config


@pytest.fixture(scope="module")
def model(make_release):
    return load_backbone(make_release(ENGINE_SPECS["two-attn"], seed=7))


def _formula_blocks(model, block_size: int, budget: int, elem: int = 4) -> tuple[int, int]:
    mc = model.config
    per_block = block_size * len(mc.full_layers) * 2 * mc.num_key_value_heads * mc.head_dim * elem
    return budget // per_block, per_block


def test_pool_sizes_follow_the_formula(model, caplog):
    mc = model.config
    config = small_config(kv_cache_mb=None, kv_fraction=0.3, block_size=16, max_num_seqs=5)
    budget = 3_000_017
    caplog.set_level(logging.INFO, logger="clefserve.engine")
    with Engine(model, config, lambda fs: [None] * len(fs), memory_budget_bytes=budget) as engine:
        stats = engine.stats()
    blocks, per_block = _formula_blocks(model, 16, int(0.3 * budget))
    slot_bytes = len(mc.linear_layers) * (
        mc.conv_dim * (mc.linear_conv_kernel_dim - 1) * 4
        + mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim * 4
    )
    assert stats["kv_blocks_total"] == stats["kv_blocks_free"] == blocks
    assert stats["kv_tokens_total"] == blocks * 16
    assert stats["kv_bytes"] == blocks * per_block
    assert stats["gdn_slots_total"] == 5
    assert stats["gdn_bytes"] == 5 * slot_bytes
    assert engine.kv.k.shape == (2, blocks, 16, mc.num_key_value_heads, mc.head_dim)
    assert engine.states.recurrent.dtype == torch.float32
    assert engine.states.recurrent[0].numel() * 4 + engine.states.conv[0].numel() * 4 == slot_bytes
    line = next(r.getMessage() for r in caplog.records if "KV pool" in r.getMessage())
    assert f"{blocks} blocks" in line and f"{blocks * 16} tokens" in line and "5 slots" in line


def test_sizing_by_megabytes_and_dtype(model):
    mc = model.config
    plan = plan_pools(mc, small_config(kv_cache_mb=3, block_size=8), torch.bfloat16, torch.device("cpu"))
    blocks, per_block = _formula_blocks(model, 8, 3 << 20, elem=2)
    assert (plan.num_blocks, plan.kv_block_bytes) == (blocks, per_block)
    assert plan.kv_block_bytes == kv_bytes_per_block(mc, 8, torch.bfloat16)
    assert plan.gdn_slot_bytes == gdn_bytes_per_slot(mc, torch.bfloat16)
    # --kv-cache-mb wins over --kv-fraction, and a budget below one block is a startup error
    assert plan_pools(mc, small_config(kv_cache_mb=3), torch.float32, torch.device("cpu"), 1).num_blocks > 0
    with pytest.raises(ValueError, match="smaller than one block"):
        plan_pools(mc, small_config(kv_cache_mb=None), torch.float32, torch.device("cpu"), 10)
    assert available_memory(torch.device("cpu")) > 0


def test_the_prefix_cache_gets_at_most_half_of_what_the_pools_leave(model, caplog):
    mc = model.config
    cpu = torch.device("cpu")
    free = 64 << 20
    roomy = plan_pools(mc, small_config(kv_cache_mb=None, kv_fraction=0.25, prefix_cache_mb=8),
                       torch.float32, cpu, free)
    assert roomy.prefix_cache_bytes == 8 << 20
    caplog.set_level(logging.WARNING, logger="clefserve.engine")
    tight = plan_pools(mc, small_config(kv_cache_mb=None, kv_fraction=0.5, prefix_cache_mb=512),
                       torch.float32, cpu, free)
    left = free - tight.kv_bytes - tight.gdn_bytes
    assert tight.prefix_cache_bytes == left // 2
    assert any("--prefix-cache-mb 512 does not fit" in r.getMessage() for r in caplog.records)
    off = plan_pools(mc, small_config(kv_cache_mb=None, prefix_cache=False), torch.float32, cpu, free)
    assert off.prefix_cache_bytes == 0
    with Engine(model, small_config(kv_cache_mb=None, kv_fraction=0.5), lambda fs: [None] * len(fs),
                memory_budget_bytes=free) as engine:
        assert engine.prefix_cache is not None and engine.prefix_cache.budget_bytes == left // 2


def test_records_that_can_never_fit_are_refused_at_once(model):
    budget_blocks = 9
    _, per_block = _formula_blocks(model, 8, 0)
    config = small_config(kv_cache_mb=None, kv_fraction=1.0, block_size=8, max_length=60)
    with Engine(model, config, lambda fs: [len(f.token_ids) for f in fs],
                memory_budget_bytes=budget_blocks * per_block) as engine:
        assert engine.stats()["kv_tokens_total"] == 72
        started = time.monotonic()
        with pytest.raises(RequestError) as too_long:
            engine.submit(torch.zeros(73, dtype=torch.long))
        assert (too_long.value.status, too_long.value.error_type) == (413, "tokens_exceeded")
        assert "72" in too_long.value.message
        assert "--kv-cache-mb or --kv-fraction" in too_long.value.message  # the flags that raise it
        with pytest.raises(RequestError) as over_max:
            engine.submit(torch.zeros(61, dtype=torch.long))
        assert over_max.value.status == 413 and "60" in over_max.value.message
        assert "--max-length" in over_max.value.message
        assert time.monotonic() - started < 1.0
        assert engine.submit(torch.zeros(60, dtype=torch.long)).result(timeout=30) == 60
        assert engine.stats()["rejected"] == 2


def test_malformed_token_ids_are_422(model):
    with Engine(model, small_config(), lambda fs: [None] * len(fs)) as engine:
        for bad in ([], [model.config.vocab_size], [-1], torch.zeros(2, 3, dtype=torch.long)):
            with pytest.raises(RequestError) as err:
                engine.submit(bad)
            assert err.value.status == 422


def test_full_queue_is_429_with_retry_after(model):
    finish = PausingFinish()
    with Engine(model, small_config(max_num_seqs=1, max_queue=2), finish) as engine:
        finish.hold()
        first = engine.submit([1, 2, 3], payload=0)
        finish.wait_held()  # the worker is busy: everything else waits
        queued = [engine.submit([4, 5], payload=i) for i in (1, 2)]
        with pytest.raises(QueueFullError) as full:
            engine.submit([6], payload=3)
        assert isinstance(full.value, RequestError)
        assert (full.value.status, full.value.error_type) == (429, "overloaded")
        assert "--max-queue 2" in full.value.message  # the flag that raises it
        assert isinstance(full.value.retry_after, int) and 1 <= full.value.retry_after <= 60
        finish.release()
        assert [f.result(timeout=30) for f in (first, *queued)] == [0, 1, 2]
        assert engine.submit([7], payload=4).result(timeout=30) == 4

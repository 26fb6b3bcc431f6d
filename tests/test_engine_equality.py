"""The engine's hidden rows equal a one-piece run of each record, however the records were chunked and
batched, and whatever the free parts of the pools hold."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from clefserve.engine import Engine
from clefserve.model.cache import DenseCache, SequenceState
from clefserve.model.layers import Batch
from clefserve.model.weights import load_backbone
from tests import device as test_device
from tests.engine_support import ENGINE_SPECS, keep_hidden, random_ids, small_config
from tests.kernel_modes import KERNEL_MODES, use_kernels

TOLERANCE = 1e-5

# (max_num_seqs, prefill_chunk_size, block_size) per spec: blocks of 5 tokens do not divide the chunks
SHAPES = {"default": (3, 48, 8), "two-attn": (2, 32, 5), "causal-lm": (4, 64, 16), "qwen-decays": (3, 48, 8)}


def _lengths(chunk: int, rng: random.Random) -> list[int]:
    lengths = [1, 2, 3, 5, 9, chunk - 1, chunk + 1, 3 * chunk + 7, 1, 17, 2 * chunk]
    lengths += [rng.randint(1, 3 * chunk) for _ in range(3)]
    rng.shuffle(lengths)
    return lengths


def _submit_all(engine: Engine, records: list[torch.Tensor]) -> list[torch.Tensor]:
    with ThreadPoolExecutor(8) as pool:
        futures = list(pool.map(engine.submit, records))
    return [f.result(timeout=60) for f in futures]


def _submit_at_once(engine: Engine, records: list[torch.Tensor]) -> list[torch.Tensor]:
    """Queue every record from the engine's own thread between two steps, so that its next plan sees them
    all: which chunks share a step then does not depend on how submitting threads race the engine."""
    futures = engine.on_engine_thread(lambda: [engine.submit(ids) for ids in records])
    return [f.result(timeout=60) for f in futures]


def _shared_continuations(trace: list[tuple[tuple[int, int], ...]]) -> int:
    """Steps that ran a later chunk of one sequence beside another sequence's tokens."""
    seen: set[int] = set()
    count = 0
    for step in trace:
        ids = [seq for seq, _ in step]
        if len(ids) > 1 and any(seq in seen for seq in ids):
            count += 1
        seen.update(ids)
    return count


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("name", sorted(ENGINE_SPECS))
def test_engine_rows_equal_one_piece_runs(make_release, name, mode):
    """The engine with ``mode``'s ops against one-piece runs with the torch reference ops."""
    model = load_backbone(make_release(ENGINE_SPECS[name], seed=3), test_device.dtype(), test_device.device())
    seqs, chunk, block = SHAPES[name]
    rng = random.Random(name)
    gen = torch.Generator().manual_seed(len(name))
    records = [random_ids(model.config.vocab_size, n, gen) for n in _lengths(chunk, rng)]
    expected = [model.run_sequence(ids)[0] for ids in records]
    use_kernels(model, mode)
    # no prefix cache: it would serve the second pass whole (tests/test_prefix_cache.py covers it); long steps
    # not paused, so that long records' later pieces share steps with short records (paused steps:
    # tests/test_layer_preemption.py), and one lane, so that they share them rather than run beside them
    # (tests/test_cpu_lanes.py)
    config = small_config(max_num_seqs=seqs, prefill_chunk_size=chunk, block_size=block, prefix_cache=False,
                          layer_preemption=False, cpu_lanes=1)
    with Engine(model, config, keep_hidden) as engine:
        engine.poison_free_memory()
        first = _submit_at_once(engine, records)
        for ids, want, got in zip(records, expected, first, strict=True):
            assert got.shape == (len(ids), model.config.hidden_size)
            test_device.assert_close(got, want, TOLERANCE)
        stats = engine.stats()
        assert stats["multi_seq_steps"] > 0
        assert _shared_continuations(engine.recent_steps()) > 0
        assert max(sum(n for _, n in step) for step in engine.recent_steps()) <= chunk
        assert max(len(step) for step in engine.recent_steps()) <= seqs

        # isolation: whatever the free blocks and slots hold (NaN here) never reaches an answer
        engine.poison_free_memory()
        order = list(range(len(records)))
        rng.shuffle(order)
        again = _submit_all(engine, [records[i] for i in order])
        for i, got in zip(order, again, strict=True):
            assert torch.isfinite(got).all()
            test_device.assert_close(got, expected[i], TOLERANCE)
        stats = engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["gdn_slots_free"] == stats["gdn_slots_total"]
        assert stats["finished"] == 2 * len(records)
        assert stats["prefill_tokens"] == 2 * sum(len(r) for r in records)


def test_hidden_rows_can_be_skipped(make_release):
    model = load_backbone(make_release(ENGINE_SPECS["default"], seed=3))
    gen = torch.Generator().manual_seed(0)
    def finish(fs):
        return [(f.payload, f.hidden, len(f.token_ids)) for f in fs]

    with Engine(model, small_config(), finish) as engine:
        ids = random_ids(model.config.vocab_size, 70, gen)
        assert engine.submit(ids, payload="p", keep_hidden=False).result(timeout=30) == ("p", None, 70)


@pytest.mark.parametrize("mode", KERNEL_MODES)
@torch.inference_mode()
def test_engine_equals_a_dense_replay_of_its_own_steps(make_release, mode):
    """The same batches through the reference DenseCache give the engine's rows: the pools change nothing."""
    folder = make_release(ENGINE_SPECS["two-attn"], seed=3)
    model = use_kernels(load_backbone(folder, test_device.dtype(), test_device.device()), mode)
    gen = torch.Generator().manual_seed(5)
    records = [random_ids(model.config.vocab_size, n, gen) for n in (70, 3, 1, 33, 64, 5, 20)]

    def finish(fs):
        return [(f.seq_id, f.hidden.clone()) for f in fs]

    config = small_config(max_num_seqs=3, prefill_chunk_size=24, block_size=5)
    with Engine(model, config, finish) as engine:
        engine.poison_free_memory()
        results = _submit_all(engine, records)
        steps = engine.recent_steps()
    ids = {seq_id: record for (seq_id, _), record in zip(results, records, strict=True)}
    states = {seq_id: SequenceState() for seq_id in ids}
    rows: dict[int, list[torch.Tensor]] = {seq_id: [] for seq_id in ids}
    for step in steps:
        batch = Batch(tuple(n for _, n in step), tuple(states[s].length for s, _ in step))
        tokens = torch.cat([ids[s][states[s].length : states[s].length + n] for s, n in step])
        hidden = model(tokens, batch, DenseCache([states[s] for s, _ in step]))
        for (s, n), (_, start, end) in zip(step, batch.spans(), strict=True):
            rows[s].append(hidden[start:end])
            states[s].length += n
    for seq_id, got in results:
        if test_device.on_cpu():
            assert torch.equal(torch.cat(rows[seq_id]), got)
        else:  # a GPU may pick another fused kernel for a pool view than for a fresh tensor (alignment)
            test_device.assert_close(got, torch.cat(rows[seq_id]), TOLERANCE)

"""Engine throughput against one-at-a-time ``Backbone.run_sequence`` on a random release (never a test).

    python -m benchmarks.engine_throughput --hidden 512 --layers 8 --concurrency 8 --records 32

Prints tokens/s of both paths, the speed-up, and the engine's step statistics. Both run with the heap
thresholds the engine sets (``--heap``, ``benchmarks/heap.py``); under glibc's defaults only the one-at-a-time
path would fault its working set in again on every record.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from benchmarks.heap import add_heap_argument, prepare_heap
from benchmarks.workload import closed_loop
from clefserve.config import EngineConfig
from clefserve.engine import Engine
from clefserve.engine.openmp import release_thread_team
from clefserve.model.weights import load_backbone
from clefserve.testing.release import ReleaseSpec, build_release


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--records", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=50)
    parser.add_argument("--max-len", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    add_heap_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heap = prepare_heap(args.heap)

    heads = max(1, args.hidden // 64)
    spec = ReleaseSpec(
        head=None, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64,
        linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads,
        linear_key_head_dim=64, linear_value_head_dim=64, tokenizer_vocab=2048,
    )
    config = EngineConfig(dtype=args.dtype, max_num_seqs=args.concurrency, prefill_chunk_size=args.chunk,
                          kv_cache_mb=512, max_queue=4096)
    with tempfile.TemporaryDirectory() as folder:
        build_release(folder, spec, seed=0)
        model = load_backbone(folder, config.torch_dtype)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.records)]
    records = [torch.randint(0, vocab, (n,)) for n in lengths]
    tokens = sum(len(r) for r in records)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {args.dtype}; "
          f"{args.records} records, {tokens} tokens ({args.min_len}-{args.max_len} each); {heap}")

    model.run_sequence(records[0][:64])  # warm-up
    started = time.perf_counter()
    for ids in records:
        model.run_sequence(ids)
    reference = time.perf_counter() - started
    print(f"one at a time : {tokens / reference:8.0f} tok/s ({reference:.2f} s)")
    release_thread_team()  # as the server's loading thread does: the engine's team is then the only one

    with Engine(model, config, lambda fs: [None] * len(fs)) as engine:
        engine.submit(records[0][:64]).result()  # warm-up
        elapsed = closed_loop(engine.submit, records, args.concurrency)
        stats = engine.stats()
    print(f"engine        : {tokens / elapsed:8.0f} tok/s ({elapsed:.2f} s), "
          f"x{reference / elapsed:.2f}; {stats['steps']} steps, {stats['multi_seq_steps']} shared, "
          f"{tokens / max(1, stats['steps']):.0f} tokens/step")


if __name__ == "__main__":
    main()

"""Short records' latency beside long ones, in process: the engine's scheduling without the server's noise.

    python -m benchmarks.short_latency [--shape clef256] [--dtype f32] [--rounds 8] [--threads 2]

Each round sends fresh records (half ~``--short``, half ~``--long`` tokens, random ids, in random order) from
``--concurrency`` closed-loop clients straight to ``Engine.submit`` (no HTTP, no head, as
``benchmarks.lanes``). Before each submission a client sleeps for a random time that stands for the
request's encoding (up to ``--encode-ms`` for a short record, four times that for a long one; a sleep takes
no CPU from the engine), so the opening burst reaches the engine staggered, as through the server. Each
engine is built for its round and shut down after it.

Prints, over all rounds, the p50 and p95 latency of the short records of the opening burst (the first
``--concurrency`` records) and of those sent later, beside a short record's latency alone, and the mean wall
time of a round. ``benchmarks.systemone`` measures the same workload through the server, where the request
side and the host's phases move a p95 over a few records by tens of percent; this isolates the scheduler. To
compare two revisions, run it on each tree in turn, alternating.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.heap import add_heap_argument, prepare_heap
from benchmarks.shapes import SHAPES, add_tokenizer_argument, build_shape
from benchmarks.systemone import percentile
from benchmarks.workload import timed_closed_loop
from clefserve.config import DTYPES, EngineConfig
from clefserve.engine import Engine
from clefserve.engine.openmp import release_thread_team
from clefserve.model.backbone import Backbone
from clefserve.model.weights import load_backbone


def engine_for(model: Backbone, args: argparse.Namespace) -> Engine:
    config = EngineConfig(dtype=args.dtype, max_num_seqs=args.concurrency,
                          prefill_chunk_size=args.prefill_chunk_size, kv_cache_mb=512, max_queue=4096,
                          prefix_cache=False, audit_fraction=0.0, cpu_lanes=args.cpu_lanes)
    engine = Engine(model, config, lambda finished: [None] * len(finished))
    engine.submit(torch.zeros(64, dtype=torch.long)).result()  # warm-up
    return engine


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--shape", default="clef256", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--records", type=int, default=16, help="records per round (half short)")
    parser.add_argument("--short", type=int, default=364, help="tokens of a short record (the ~400-token "
                        "requests of benchmarks.systemone have 364 with Qwen3.5's tokenizer)")
    parser.add_argument("--long", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prefill-chunk-size", type=int, default=1024)
    parser.add_argument("--cpu-lanes", type=int, default=2, choices=(1, 2))
    parser.add_argument("--encode-ms", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_tokenizer_argument(parser)
    add_heap_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    heap = prepare_heap(args.heap)

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_shape(args.shape, Path(tmp) / "release", tokenizer=args.tokenizer)
        model = load_backbone(folder, dtype=DTYPES[args.dtype])
    release_thread_team()  # as the server's loading thread does: only the engine's teams remain
    gen, rng = torch.Generator().manual_seed(1), random.Random(0)

    def encode(record: torch.Tensor) -> None:
        time.sleep(rng.random() * args.encode_ms / 1000 * (4 if len(record) > args.short else 1))

    print(f"# {args.shape}, {args.dtype}, {args.threads} threads, {args.cpu_lanes} lane(s), {args.records} "
          f"records a round (~{args.short}/~{args.long} tokens, random order), concurrency "
          f"{args.concurrency}, chunk {args.prefill_chunk_size}, prefix cache off; {heap}")
    burst, later, alone, walls = [], [], [], []
    for i in range(args.rounds):
        sizes = [args.short, args.long] * (args.records // 2)
        rng.shuffle(sizes)
        records = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in sizes]
        engine = engine_for(model, args)
        try:
            wall, latencies = timed_closed_loop(engine.submit, records, args.concurrency, encode)
            for record in records[:2]:
                started = time.perf_counter()
                engine.submit(record[: args.short]).result()
                alone.append(time.perf_counter() - started)
        finally:
            engine.shutdown()
        walls.append(wall)
        shorts = [(j, t) for j, (n, t) in enumerate(zip(sizes, latencies, strict=True)) if n == args.short]
        round_burst = [t for j, t in shorts if j < args.concurrency]
        burst += round_burst
        later += [t for j, t in shorts if j >= args.concurrency]
        last = max(round_burst, default=0.0)
        print(f"round {i + 1}: {wall:.2f} s, the opening burst's last short record after {last:.3f} s")

    def line(name: str, values: list[float]) -> str:
        return (f"{name}: p50 {percentile(values, 0.5):.3f} s, p95 {percentile(values, 0.95):.3f} s "
                f"({len(values)} records)")

    print(line("short records alone", alone))
    print(line("short records of the opening burst", burst))
    print(line("short records sent later", later))
    print(line("all short records", burst + later))
    print(f"wall per round: mean {statistics.mean(walls):.2f} s")


if __name__ == "__main__":
    main()

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
import time

import torch

from benchmarks.systemone import percentile
from benchmarks.workload import add_engine_round_arguments, round_backbone, round_engine, timed_closed_loop


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    add_engine_round_arguments(parser, short=364)  # the ~400-token requests of benchmarks.systemone
    parser.add_argument("--cpu-lanes", type=int, default=2, choices=(1, 2))
    parser.add_argument("--encode-ms", type=float, default=3.0)
    args = parser.parse_args(argv)
    model, heap = round_backbone(args)
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
        engine = round_engine(model, args, args.cpu_lanes)
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
        if not values:
            return f"{name}: none"
        return (f"{name}: p50 {percentile(values, 0.5):.3f} s, p95 {percentile(values, 0.95):.3f} s "
                f"({len(values)} records)")

    print(line("short records alone", alone))
    print(line("short records of the opening burst", burst))
    print(line("short records sent later", later))
    print(line("all short records", burst + later))
    print(f"wall per round: mean {statistics.mean(walls):.2f} s")


if __name__ == "__main__":
    main()

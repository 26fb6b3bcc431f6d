"""CPU lanes on and off: the same engine workload through an engine with one lane and one with two, in one
process, alternating round by round (``--cpu-lanes``, ``clefserve.engine.lanes``).

    python -m benchmarks.lanes [--shape clef256] [--dtype f32] [--rounds 8] [--threads 2]

Each round sends the same fresh mixed records (half ~``--short``, half ~``--long`` tokens, random ids) from
``--concurrency`` closed-loop clients straight to ``Engine.submit`` (no HTTP, no head), first to one engine
and then to the other, the order swapped every round; each engine is built for its round and shut down
after it, so that no idle engine's OpenMP team sits beside the one measured (``clefserve.engine.openmp``).
Prints each round's wall time on both and the ratio one lane / two lanes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.heap import add_heap_argument, prepare_heap
from benchmarks.shapes import SHAPES, add_tokenizer_argument, build_shape
from benchmarks.workload import closed_loop
from clefserve.config import DTYPES, EngineConfig
from clefserve.engine import Engine
from clefserve.engine.openmp import release_thread_team
from clefserve.model.backbone import Backbone
from clefserve.model.weights import load_backbone


def run_round(model: Backbone, config: EngineConfig, records: list[torch.Tensor], concurrency: int) -> float:
    engine = Engine(model, config, lambda finished: [None] * len(finished))
    try:
        engine.submit(records[0][:64]).result()  # warm-up
        return closed_loop(engine.submit, records, concurrency)
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--shape", default="clef256", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--records", type=int, default=16, help="records per round (half short)")
    parser.add_argument("--short", type=int, default=400)
    parser.add_argument("--long", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prefill-chunk-size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_tokenizer_argument(parser)
    add_heap_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    heap = prepare_heap(args.heap)

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_shape(args.shape, Path(tmp) / "release", tokenizer=args.tokenizer)
        model = load_backbone(folder, dtype=DTYPES[args.dtype])
    release_thread_team()  # as the server's loading thread does: only the engines' teams remain
    gen = torch.Generator().manual_seed(1)
    seconds: dict[int, list[float]] = {1: [], 2: []}
    print(f"# {args.shape}, {args.dtype}, {args.threads} threads, {args.records} records a round "
          f"(~{args.short}/~{args.long} tokens), concurrency {args.concurrency}, chunk "
          f"{args.prefill_chunk_size}, prefix cache off; {heap}")
    for i in range(args.rounds):
        records = [torch.randint(0, model.config.vocab_size, (args.long if j % 2 else args.short,),
                                 generator=gen) for j in range(args.records)]
        for lanes in ((1, 2) if i % 2 == 0 else (2, 1)):
            config = EngineConfig(dtype=args.dtype, max_num_seqs=args.concurrency,
                                  prefill_chunk_size=args.prefill_chunk_size, kv_cache_mb=512,
                                  max_queue=4096, prefix_cache=False, audit_fraction=0.0, cpu_lanes=lanes)
            seconds[lanes].append(run_round(model, config, records, args.concurrency))
        print(f"round {i + 1}: one lane {seconds[1][-1]:.2f} s, two lanes {seconds[2][-1]:.2f} s, "
              f"x{seconds[1][-1] / seconds[2][-1]:.2f}")
    one, two = sum(seconds[1]), sum(seconds[2])
    print(f"total: one lane {one:.2f} s, two lanes {two:.2f} s: two lanes x{one / two:.3f}")


if __name__ == "__main__":
    main()

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

import torch

from benchmarks.workload import add_engine_round_arguments, closed_loop, round_backbone, round_engine
from clefserve.model.backbone import Backbone


def run_round(model: Backbone, args: argparse.Namespace, records: list[torch.Tensor], lanes: int) -> float:
    engine = round_engine(model, args, lanes)
    try:
        return closed_loop(engine.submit, records, args.concurrency)
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    add_engine_round_arguments(parser)
    args = parser.parse_args(argv)
    model, heap = round_backbone(args)
    gen = torch.Generator().manual_seed(1)
    seconds: dict[int, list[float]] = {1: [], 2: []}
    print(f"# {args.shape}, {args.dtype}, {args.threads} threads, {args.records} records a round "
          f"(~{args.short}/~{args.long} tokens), concurrency {args.concurrency}, chunk "
          f"{args.prefill_chunk_size}, prefix cache off; {heap}")
    for i in range(args.rounds):
        records = [torch.randint(0, model.config.vocab_size, (args.long if j % 2 else args.short,),
                                 generator=gen) for j in range(args.records)]
        for lanes in ((1, 2) if i % 2 == 0 else (2, 1)):
            seconds[lanes].append(run_round(model, args, records, lanes))
        print(f"round {i + 1}: one lane {seconds[1][-1]:.2f} s, two lanes {seconds[2][-1]:.2f} s, "
              f"x{seconds[1][-1] / seconds[2][-1]:.2f}")
    one, two = sum(seconds[1]), sum(seconds[2])
    print(f"total: one lane {one:.2f} s, two lanes {two:.2f} s: two lanes x{one / two:.3f}")


if __name__ == "__main__":
    main()

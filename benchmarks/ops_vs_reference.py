"""Our engine against Cloudflare's reference, op family by op family, in one process.

    python -m benchmarks.ops_vs_reference [--dtype bf16] [--tokens 3000] [--records 4] [--rounds 3]

The server (FastAPI + engine) runs in this process on a loopback port, the reference (``systemone()`` over
transformers' Qwen3.5) on the main thread, same release, dtype and threads. First ``--rounds`` rounds of
``--records`` fresh records of ~``--tokens`` tokens each: each round sends them one at a time through each
side (wall ms per record), then again through each side under ``torch.profiler``. Printed: the walls, and
each aten op's self CPU time per record over all rounds (this host's speed moves by up to 2x between
minutes, so one profiled set per side says little). Ours is the engine thread's ops (as ``benchmarks.profile
--ops``), the reference's the main thread's.

After each reference run its thread's OpenMP team is released, as the server does for every thread but the
engine's: left alive, it makes the engine's team wait in libgomp's throttled mode (the engine's GEMMs took
74 ms a 3,000-token record instead of 52). Needs the test extras (transformers, clef-finetune).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import torch

from benchmarks.heap import add_heap_argument, prepare_heap
from benchmarks.profile import EngineOps, serve_in_thread
from benchmarks.shapes import SHAPES, add_tokenizer_argument, build_shape
from benchmarks.workload import make_request
from clefserve.config import DTYPES, EngineConfig
from clefserve.engine.openmp import release_thread_team
from clefserve.formats.clef.decider import ClefDecider
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.testing.server_process import free_port


def add_per_op(totals: dict[str, float], profiler: torch.profiler.profile, records: int) -> None:
    """Add each aten op's self CPU milliseconds, divided by ``records``, to ``totals``."""
    for event in profiler.key_averages():
        totals[event.key] += event.self_cpu_time_total / 1e3 / records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="clef256", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--records", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30, help="ops printed")
    add_heap_argument(parser)
    add_tokenizer_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    heap = prepare_heap(args.heap)

    from tests.oracles import jsm, reference_clef

    dtype = DTYPES[args.dtype]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_shape(args.shape, Path(tmp) / "release", tokenizer=args.tokenizer)
        decider = ClefDecider(folder, dtype)
        config = EngineConfig(dtype=args.dtype, port=free_port(), max_num_seqs=8, prefill_chunk_size=1024,
                              kv_cache_mb=2048, max_length=max(16384, args.tokens + 1024), audit_fraction=0.0)
        backend = EngineBackend(decider, config, "bench")
        server, thread, _ = serve_in_thread(backend, config)
        reference, (model, processor) = jsm(), reference_clef(folder, dtype)

        def fresh() -> list[dict]:
            return [make_request(decider.encoder, args.tokens, rng) for _ in range(args.records)]

        def ours(requests: list[dict]) -> None:
            for request in requests:
                client.post("/v1/systemone", json=request).raise_for_status()

        def theirs(requests: list[dict]) -> None:
            for request in requests:
                reference.systemone(model, processor, request)
            release_thread_team()

        with httpx.Client(base_url=f"http://127.0.0.1:{config.port}", timeout=3600) as client:
            warm = fresh()[:1]
            ours(warm)
            theirs(warm)
            walls: dict[str, list[float]] = {"ours": [], "reference": []}
            mine: dict[str, float] = defaultdict(float)
            base: dict[str, float] = defaultdict(float)
            for _ in range(args.rounds):
                requests = fresh()
                for side, run in (("ours", ours), ("reference", theirs)):
                    started = time.perf_counter()
                    run(requests)
                    walls[side].append((time.perf_counter() - started) * 1e3 / args.records)
                requests = fresh()  # our prefix cache holds the last ones whole
                with EngineOps(backend.engine) as engine_ops:
                    ours(requests)
                with torch.profiler.profile() as reference_ops:
                    theirs(requests)
                add_per_op(mine, engine_ops.profiler, args.records * args.rounds)
                add_per_op(base, reference_ops, args.records * args.rounds)
        server.should_exit = True
        thread.join(30)

    print(f"# shape {args.shape}, tokenizer {args.tokenizer}, {args.dtype}, {args.threads} threads, "
          f"{args.records} records of ~{args.tokens} tokens a round; reference: {heap}")
    for side, values in walls.items():
        print(f"wall ms per record, {side:<9}: {' '.join(f'{v:.0f}' for v in values)}")
    print(f"{'self CPU ms per record':<46} {'ours':>8} {'reference':>10}")
    for op in sorted(set(mine) | set(base), key=lambda k: -(mine.get(k, 0.0) + base.get(k, 0.0)))[:args.rows]:
        print(f"{op[:46]:<46} {mine.get(op, 0.0):8.1f} {base.get(op, 0.0):10.1f}")
    print(f"{'all ops':<46} {sum(mine.values()):8.1f} {sum(base.values()):10.1f}")


if __name__ == "__main__":
    main()

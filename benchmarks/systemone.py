"""System One throughput: our server (a real process, over HTTP) against Cloudflare's reference
``systemone()`` called in-process one request at a time: same release, dtype, threads and CPU, side by side in
one run.

    python -m benchmarks.systemone [--shape clef256] [--dtypes f32 bf16] [--sizes 400 3000 12000]
                                   [--concurrency 8] [--requests 16] [--threads 2] [--repeat 3]

For each dtype it prints:

- one request at a time, each record size alone (``--sizes``, ``--per-size`` requests each): reference vs
  ours at concurrency 1;
- the mixed workload (half ~``--short``, half ~``--long`` tokens, fresh states, ``--requests`` requests):
  reference one at a time vs ours at each ``--concurrency``, and the p95 latency of the short records in
  the mixed run against their p95 alone, split into the opening burst and the records sent later, and the
  floor of that burst (as many short records sent together with nothing else);
- the long-record prefill of our backbone as a share of this machine's measured matmul peak, in the
  arithmetic this CPU computes the dtype's projections in (fp32 for bf16 on a CPU without bf16 instructions):
  ``--prefill-rounds`` rounds, each prefill followed at once by its own peak measurement, and the median of
  the rounds' shares (a share of a peak measured minutes apart would mostly measure the host's phases).

Three questions per record (noul, choice, score) on a random Clef-shaped release (``benchmarks.shapes``).
The reference runs in this process with the heap thresholds our server sets (``--heap``,
``benchmarks/heap.py``) and, with ``--heap kept``, its loaded objects frozen out of the garbage collector's
passes once built, as the server freezes its own (``clefserve.engine.python_heap``): the comparison is between
the engines, not process settings. Needs the test extras (transformers, clef-finetune).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from benchmarks.flops import matmul_peak, prefill_flops
from benchmarks.heap import add_heap_argument, prepare_heap
from benchmarks.shapes import SHAPES, add_tokenizer_argument, build_shape
from benchmarks.workload import make_request
from clefserve.config import DTYPES
from clefserve.engine.openmp import release_thread_team
from clefserve.engine.python_heap import freeze_loaded_objects
from clefserve.engine.subnormals import flush_subnormals_here
from clefserve.formats.clef.encoder import ClefEncoder
from clefserve.model.ops import gemm
from clefserve.model.ops.select import select_ops
from clefserve.model.weights import load_backbone
from clefserve.testing.server_process import ServerProcess


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Run:
    """One measurement: wall time, per-request latencies and input tokens."""

    def __init__(self, wall: float, latencies: list[float], tokens: list[int]) -> None:
        self.wall, self.latencies, self.tokens = wall, latencies, tokens

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.wall

    def report(self, label: str, base: Run | None = None) -> None:
        ratio = f"{self.rate / base.rate:6.2f}x" if base else "      -"
        p50, p95 = statistics.median(self.latencies), percentile(self.latencies, 0.95)
        print(f"  {label:<38} {self.rate:7.2f} req/s {sum(self.tokens) / self.wall:8.0f} tok/s  "
              f"p50 {p50:6.2f}s  p95 {p95:6.2f}s  {ratio}")

    def p95_of(self, short: int) -> float:
        """p95 latency of the requests with at most ``short`` tokens."""
        return percentile([t for t, n in zip(self.latencies, self.tokens, strict=True) if n <= short], 0.95)


def report_short_latency(rounds: list[Run], alone: Run, concurrency: int, burst_alone: Callable[[int], Run],
                         repeat: int) -> None:
    """The short records' p95 in the mixed rounds against their p95 alone, split into those of the opening
    burst (the first ``concurrency`` requests go out together) and those sent later (each right after an
    answer, so just after the next step began). Beside it, the floor of the burst: ``burst_alone(k)`` runs
    k fresh short records sent together with nothing else (the last to answer, median of ``repeat``
    tries), k the most short records a burst held; on a CPU the engine serves several short records no
    faster together than one after another, so no schedule answers the last of such a burst sooner."""
    cut = 2 * max(alone.tokens)  # records carry the schema's tokens too
    alone_p95 = alone.p95_of(cut)
    opening = [[t for t, n in zip(r.latencies[:concurrency], r.tokens[:concurrency], strict=True) if n <= cut]
               for r in rounds]
    later = [t for r in rounds for t, n in zip(r.latencies[concurrency:], r.tokens[concurrency:], strict=True)
             if n <= cut]
    mixed_p95 = merged(rounds).p95_of(cut)
    print(f"    short records: p95 {mixed_p95:.2f}s in the mixed run, {alone_p95:.2f}s alone "
          f"({mixed_p95 / alone_p95:.2f}x)")
    burst = max(len(o) for o in opening)
    parts = []
    if burst:
        p95 = percentile([t for o in opening for t in o], 0.95)
        parts.append(f"opening burst (up to {burst} short) p95 {p95:.2f}s ({p95 / alone_p95:.2f}x)")
    if later:
        p95 = percentile(later, 0.95)
        parts.append(f"sent later p95 {p95:.2f}s ({p95 / alone_p95:.2f}x)")
    if parts:
        print("    of which " + "; ".join(parts))
    if burst > 1:
        last = statistics.median(max(burst_alone(burst).latencies) for _ in range(repeat))
        print(f"    floor: {burst} short records sent together alone answer the last after {last:.2f}s "
              f"({last / alone_p95:.2f}x)")


def round_ratios(base: list[Run], ours: list[Run]) -> str:
    """Ours against the reference in each round, so that the spread of a noisy machine shows."""
    if len(base) < 2:
        return ""
    ratios = sorted(o.rate / b.rate for b, o in zip(base, ours, strict=True))
    listed = ", ".join(f"{r:.2f}x" for r in ratios)
    return f"    per round: {listed} (median {statistics.median(ratios):.2f}x)"


def merged(runs: list[Run]) -> Run:
    """Rounds of one measurement as one: requests over the summed wall time, every latency."""
    return Run(sum(r.wall for r in runs), [t for r in runs for t in r.latencies],
               [n for r in runs for n in r.tokens])


class Reference:
    """Cloudflare's ``systemone()`` over transformers' Qwen3.5, one request at a time."""

    def __init__(self, folder: Path, dtype: torch.dtype, freeze: bool) -> None:
        """``freeze``: then freeze this process's objects out of the garbage collector's passes."""
        from tests.oracles import jsm, reference_clef

        self.jsm = jsm()
        self.model, self.processor = reference_clef(folder, dtype)
        if freeze:
            freeze_loaded_objects()

    def run(self, requests: list[dict]) -> Run:
        self.jsm.systemone(self.model, self.processor, {**requests[0], "state": "warm-up"})
        latencies, tokens, start = [], [], time.perf_counter()
        for request in requests:
            t = time.perf_counter()
            tokens.append(self.jsm.systemone(self.model, self.processor, request)["usage"]["input_tokens"])
            latencies.append(time.perf_counter() - t)
        return Run(time.perf_counter() - start, latencies, tokens)


def run_server(url: str, requests: list[dict], concurrency: int) -> Run:
    with httpx.Client(base_url=url, timeout=3600) as client:
        client.post("/v1/systemone", json={**requests[0], "state": "warm-up"}).raise_for_status()

        def call(request: dict) -> tuple[float, int]:
            t = time.perf_counter()
            response = client.post("/v1/systemone", json=request)
            response.raise_for_status()
            return time.perf_counter() - t, response.json()["usage"]["input_tokens"]

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(call, requests))
        wall = time.perf_counter() - start
    return Run(wall, [r[0] for r in results], [r[1] for r in results])


@dataclass(frozen=True)
class PrefillShare:
    """The long-record prefill against the matmul peak measured beside it, round by round."""

    achieved: list[float]  # FLOP/s of each round's prefill
    peaks: list[float]  # FLOP/s of each round's peak matmuls, measured right after that prefill
    arithmetic: torch.dtype  # the dtype of the peak: what this CPU computes the projections in

    @property
    def shares(self) -> list[float]:
        return [a / p for a, p in zip(self.achieved, self.peaks, strict=True)]


def long_prefill_utilisation(
        folder: Path, dtype: torch.dtype, tokens: int, rounds: int = 5) -> PrefillShare:
    """Our backbone (serving ops) on one ``tokens``-long record in engine-sized pieces against the matmul
    peak, ``rounds`` times, each prefill followed at once by the peak's matmuls in the dtype this CPU computes
    ``dtype``'s projections in (:func:`clefserve.model.ops.gemm.compute_dtype`). Each round's share is of the
    peak measured in the same phase of the host, whose speed moves by up to 2x between minutes. Timed on a
    thread of its own that flushes subnormals, as the engine's does."""
    model = load_backbone(folder, dtype=dtype)
    model.set_ops(select_ops(model.device, dtype))
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    arithmetic = gemm.compute_dtype(model.device, dtype)
    sizes = (1024, 2048, 3072) if arithmetic == torch.float32 else (1024, 2048)
    flops = prefill_flops(model.config, tokens)

    def run() -> None:
        state = None
        for start in range(0, tokens, 1024):
            _, state = model.run_sequence(ids[start : start + 1024], state)

    def measure() -> PrefillShare:
        flush_subnormals_here()
        try:
            with torch.inference_mode():
                run()
                achieved, peaks = [], []
                for _ in range(rounds):
                    achieved.append(flops / _timed(run))
                    peaks.append(matmul_peak(arithmetic, sizes, trials=1))
                return PrefillShare(achieved, peaks, arithmetic)
        finally:
            release_thread_team()

    release_thread_team()  # this thread's idle team would throttle the timed one's (clefserve.engine.openmp)
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(measure).result()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="clef256", choices=sorted(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["f32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--sizes", type=int, nargs="*", default=[400, 3000, 12000],
                        help="record sizes measured alone at concurrency 1 (none: skip)")
    parser.add_argument("--per-size", type=int, default=3, help="requests per size alone")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8],
                        help="concurrency levels of the mixed workload (none: skip it)")
    parser.add_argument("--requests", type=int, default=16, help="mixed workload requests (half short)")
    parser.add_argument("--short", type=int, default=400)
    parser.add_argument("--long", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of each comparison, reference and ours alternating (a noisy machine "
                             "slows both sides alike); the figures add the rounds up")
    parser.add_argument("--server-args", default="--max-num-seqs 8 --prefill-chunk-size 1024",
                        help="extra clef-serve flags")
    parser.add_argument("--prefill-rounds", type=int, default=5,
                        help="rounds of the long-record prefill, each beside its own peak measurement "
                             "(0: skip)")
    add_heap_argument(parser)
    add_tokenizer_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    heap = prepare_heap(args.heap)

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_shape(args.shape, Path(tmp) / "release", tokenizer=args.tokenizer)
        encoder = ClefEncoder.from_folder(folder)
        rng = random.Random(0)

        def fresh(lengths: list[int]) -> list[dict]:
            # fresh states for every measurement: a prefix cache may only reuse what real traffic shares
            batch = [make_request(encoder, length, rng) for length in lengths]
            rng.shuffle(batch)
            return batch

        mixed = [args.long if i % 2 else args.short for i in range(args.requests)]
        print(f"# shape {args.shape}, tokenizer {args.tokenizer}, {args.threads} threads, server: "
              f"{args.server_args}; mixed: "
              f"{args.requests} requests (~{args.short}/~{args.long} tokens); {args.repeat} round(s) each, "
              f"reference and ours alternating; reference: {heap}"
              f"{', loaded objects frozen' if args.heap == 'kept' else ''}")
        for name in args.dtypes:
            dtype = DTYPES[name]
            print(f"{name}:")
            reference = Reference(folder, dtype, freeze=args.heap == "kept")
            log = Path(tmp) / f"server-{name}.log"
            extra = ["--dtype", name, "--max-length", str(max([*args.sizes, args.long]) + 1024),
                     *args.server_args.split()]
            with ServerProcess(folder, log, *extra, threads=args.threads) as server:
                alone_short: Run | None = None
                for size in args.sizes:
                    rounds = [(reference.run(fresh([size] * args.per_size)),
                               run_server(server.url, fresh([size] * args.per_size), 1))
                              for _ in range(args.repeat)]
                    base, ours = merged([b for b, _ in rounds]), merged([o for _, o in rounds])
                    base.report(f"~{size} tokens: reference, 1 at a time")
                    ours.report(f"~{size} tokens: clef-serve, concurrency 1", base)
                    if spread := round_ratios([b for b, _ in rounds], [o for _, o in rounds]):
                        print(spread)
                    if size == args.short:
                        alone_short = ours
                if args.concurrency:
                    rounds = [(reference.run(fresh(mixed)),
                               [run_server(server.url, fresh(mixed), c) for c in args.concurrency])
                              for _ in range(args.repeat)]
                    base = merged([b for b, _ in rounds])
                    base.report("mixed: reference, 1 at a time")
                    for i, concurrency in enumerate(args.concurrency):
                        ours = merged([runs[i] for _, runs in rounds])
                        ours.report(f"mixed: clef-serve, concurrency {concurrency}", base)
                        if spread := round_ratios([b for b, _ in rounds], [runs[i] for _, runs in rounds]):
                            print(spread)
                        if alone_short is not None:
                            report_short_latency(
                                [runs[i] for _, runs in rounds], alone_short, concurrency,
                                lambda k: run_server(server.url, fresh([args.short] * k), k), args.repeat)
            del reference
            if args.prefill_rounds < 1:
                continue
            prefill = long_prefill_utilisation(folder, dtype, args.long, args.prefill_rounds)
            peak_name = next(key for key, value in DTYPES.items() if value == prefill.arithmetic)
            computed_in = "" if prefill.arithmetic == dtype else f", what this CPU runs {name} projections in"
            shares = prefill.shares
            print(f"  long-record prefill ({args.long} tokens): "
                  f"{statistics.median(prefill.achieved) / 1e9:.1f} GFLOP/s = "
                  f"{100 * statistics.median(shares):.0f}% of the {peak_name} matmul peak measured beside it "
                  f"({statistics.median(prefill.peaks) / 1e9:.1f} GFLOP/s{computed_in}); medians of "
                  f"{len(shares)} rounds, shares {100 * min(shares):.0f}-{100 * max(shares):.0f}%")


if __name__ == "__main__":
    main()

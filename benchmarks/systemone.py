"""System One throughput: our server (a real process, over HTTP) against Cloudflare's reference
``systemone()`` called in-process one request at a time: same release, dtype and CPU, side by side in one
run.

    python -m benchmarks.systemone [--dtypes f32 bf16] [--concurrency 1 4 8 16] [--requests 16]

Workload: half short records (~400 tokens), half long ones (~3,000), three questions each (noul, choice,
score) on a Clef-shaped random release (hidden 256, 8 layers). Also prints the machine's matmul peak and
the share of it our long-record prefill reaches. Needs the test extras (transformers, clef-finetune).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from benchmarks.flops import matmul_peak, prefill_flops
from clefserve.config import DTYPES
from clefserve.formats.clef.encoder import ClefEncoder
from clefserve.model.weights import load_backbone
from clefserve.testing.release import build_release, clef_shaped_spec
from clefserve.testing.server_process import ServerProcess
from clefserve.testing.tokenizer import WORDS


def make_request(encoder: ClefEncoder, tokens: int, rng: random.Random) -> dict:
    questions = {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {"type": "choice", "instructions": "Which team should handle it?",
                 "criteria": {"billing": "Payments and refunds", "technical": "Bugs and outages",
                              "sales": "Plans and prices", "account": None}},
        "urgency": {"type": "score", "instructions": "How urgent is it?",
                    "criteria": ["Can wait", "This week", "Today", "Right now"]},
    }
    words: list[str] = []
    request = {"model": "bench", "state": "", "questions": questions}
    while len(encoder.encode(request).input_ids) < tokens:
        words.extend(rng.choices(WORDS, k=64))
        request["state"] = {"ticket": rng.randint(1, 99999), "message": " ".join(words)}
    return request


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(label: str, wall: float, latencies: list[float], tokens: int, base: float | None) -> float:
    rate = len(latencies) / wall
    ratio = f"{rate / base:6.2f}x" if base else "      -"
    p50, p95 = statistics.median(latencies), percentile(latencies, 0.95)
    throughput = f"{rate:7.2f} req/s {tokens / wall:9.0f} tok/s"
    print(f"  {label:<34} {throughput}  p50 {p50:6.2f}s  p95 {p95:6.2f}s  {ratio}")
    return rate


def run_reference(folder: Path, dtype: torch.dtype, requests: list[dict]) -> tuple[float, list[float], int]:
    from tests.oracles import jsm, reference_clef

    model, processor = reference_clef(folder, dtype)
    jsm().systemone(model, processor, requests[0])  # warm-up
    latencies, tokens, start = [], 0, time.perf_counter()
    for request in requests:
        t = time.perf_counter()
        tokens += jsm().systemone(model, processor, request)["usage"]["input_tokens"]
        latencies.append(time.perf_counter() - t)
    return time.perf_counter() - start, latencies, tokens


def run_server(url: str, requests: list[dict], concurrency: int) -> tuple[float, list[float], int]:
    with httpx.Client(base_url=url, timeout=600) as client:
        warm_up = {**requests[0], "state": "warm-up"}  # not one of the measured states
        client.post("/v1/systemone", json=warm_up).raise_for_status()

        def call(request: dict) -> tuple[float, int]:
            t = time.perf_counter()
            response = client.post("/v1/systemone", json=request)
            response.raise_for_status()
            return time.perf_counter() - t, response.json()["usage"]["input_tokens"]

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(call, requests))
        wall = time.perf_counter() - start
    return wall, [r[0] for r in results], sum(r[1] for r in results)


def long_prefill_utilisation(folder: Path, dtype: torch.dtype, tokens: int) -> tuple[float, float]:
    model = load_backbone(folder, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    model.run_sequence(ids)
    best = min(_timed(lambda: model.run_sequence(ids)) for _ in range(3))
    achieved = prefill_flops(model.config, tokens) / best
    return achieved, achieved / matmul_peak(dtype)


def _timed(fn) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", nargs="+", default=["f32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests per measurement (half short)")
    parser.add_argument("--short", type=int, default=400)
    parser.add_argument("--long", type=int, default=3000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--server-args", default="--max-num-seqs 8 --prefill-chunk-size 1024",
                        help="extra clef-serve flags")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_release(Path(tmp) / "release", clef_shaped_spec(args.hidden, args.layers), seed=0)
        encoder = ClefEncoder.from_folder(folder)
        rng = random.Random(0)
        lengths = [args.long if i % 2 else args.short for i in range(args.requests)]

        def workload() -> list[dict]:
            # fresh states for every measurement: a prefix cache may only reuse what real traffic shares
            batch = [make_request(encoder, length, rng) for length in lengths]
            rng.shuffle(batch)
            return batch

        print(f"# hidden {args.hidden}, {args.layers} layers, {args.requests} requests "
              f"(~{args.short}/~{args.long} tokens), {args.threads} threads, server: {args.server_args}")
        for name in args.dtypes:
            dtype = DTYPES[name]
            print(f"{name}:")
            wall, latencies, tokens = run_reference(folder, dtype, workload())
            base = report("reference systemone(), 1 at a time", wall, latencies, tokens, None)
            extra = ["--dtype", name, *args.server_args.split()]
            log = Path(tmp) / f"server-{name}.log"
            with ServerProcess(folder, log, *extra, threads=args.threads) as server:
                for concurrency in args.concurrency:
                    wall, latencies, tokens = run_server(server.url, workload(), concurrency)
                    report(f"clef-serve, concurrency {concurrency}", wall, latencies, tokens, base)
            achieved, share = long_prefill_utilisation(folder, dtype, args.long)
            print(f"  long-record prefill ({args.long} tokens): {achieved / 1e9:.1f} GFLOP/s = "
                  f"{100 * share:.0f}% of the measured {name} matmul peak")


if __name__ == "__main__":
    main()

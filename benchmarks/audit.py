"""The live audit's cost: the same workload through the engine with ``--audit-fraction 0`` and with
``--audit-fraction F`` (default 0.01), in alternating rounds of one run (in-process EngineBackend, never a
test).

    python -m benchmarks.audit [--rounds 3] [--requests 240] [--concurrency 8] [--fraction 0.01]

Workload: ``--concurrency`` clients in a closed loop, records of about 400 and 1,500 tokens (one in four
long), 1 to 3 questions, states shared by a few requests (prefix cache hits), on a Clef-shaped random
release (hidden 256, 8 layers). Rounds alternate off/on so that drift of a shared machine hits both sides;
after each audited round the audit queue is drained, untimed, so that no audit runs during the next round
(its reference compute is printed). Prints throughput and p50/p95 latency of each side, the ratios against
the targets (throughput within 3% of audit off, p95 at most 5% higher), how many audits ran inside the timed
rounds, and the load average (run it on a quiet machine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch

from clefserve.config import EngineConfig
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.testing.release import build_release, clef_shaped_spec
from clefserve.testing.tokenizer import WORDS


def make_requests(decider: ClefDecider, count: int, rng: random.Random) -> list[dict[str, Any]]:
    def text(n: int) -> str:
        return " ".join(rng.choices(WORDS, k=n))

    def state(tokens: int) -> dict[str, Any]:
        words: list[str] = []
        while True:
            body = {"model": "bench", "state": {"ticket": rng.randint(1, 99999), "message": " ".join(words)},
                    "questions": {"q": {"type": "noul"}}}
            record = decider.encode(body)
            if record.state_end - record.prefix_end >= tokens:
                return body["state"]
            words.extend(rng.choices(WORDS, k=48))

    states = [state(1300 if i % 4 == 0 else 200) for i in range(max(1, count // 3))]
    requests = []
    for _ in range(count):
        questions: dict[str, Any] = {}
        for j in range(rng.randint(1, 3)):
            kind = rng.choice(["noul", "choice", "score"])
            if kind == "noul":
                questions[f"q{j}"] = {"type": "noul", "instructions": f"Is it about {text(2)}?"}
            elif kind == "choice":
                questions[f"q{j}"] = {"type": "choice", "instructions": f"Which {text(1)}?",
                                      "criteria": {label: None for label in rng.sample(WORDS, 3)}}
            else:
                questions[f"q{j}"] = {"type": "score", "criteria": [text(1) for _ in range(4)]}
        requests.append({"model": "bench", "state": rng.choice(states), "questions": questions})
    return requests


async def closed_loop(backend: EngineBackend, requests: list[dict[str, Any]], concurrency: int,
                      tag: str) -> tuple[float, list[float]]:
    """Wall seconds and per-request latencies."""
    async def connected() -> bool:
        return False

    queue = list(enumerate(requests))
    latencies: list[float] = []

    async def client() -> None:
        while queue:
            i, body = queue.pop(0)
            started = time.perf_counter()
            await backend.decide(body, f"{tag}-{i}", connected)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies


def concluded(backend: EngineBackend) -> int:
    audit = backend.stats()["audit"]
    return audit["match"] + audit["mismatch"]


def drain(backend: EngineBackend) -> float:
    """Wait until the audit has nothing queued or running; returns the seconds it took."""
    started = time.perf_counter()
    while True:
        audit = backend.stats()["audit"]
        if not audit["queued"] and not audit["running"]:
            return time.perf_counter() - started
        time.sleep(0.005)


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[18]


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each side, alternating")
    parser.add_argument("--requests", type=int, default=240, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.01)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as folder:
        build_release(folder, clef_shaped_spec(args.hidden, args.layers), seed=0)
        decider = ClefDecider(folder)
    rng = random.Random(0)
    rounds = [make_requests(decider, args.requests, rng) for _ in range(args.rounds)]
    tokens = sum(len(decider.encode(r).input_ids) for r in rounds[0]) / args.requests
    print(f"{args.rounds} rounds x 2 sides x {args.requests} requests (~{tokens:.0f} tokens a record), "
          f"{args.concurrency} clients; hidden {args.hidden}, {args.layers} layers, "
          f"{args.threads} thread(s); {os.cpu_count()} CPUs, load average before {os.getloadavg()[0]:.2f}")

    base = dict(max_num_seqs=8, prefill_chunk_size=1024, kv_cache_mb=1024, max_queue=4096)
    sides = {"off": EngineBackend(decider, EngineConfig(**base, audit_fraction=0.0), "bench"),
             "on": EngineBackend(decider, EngineConfig(**base, audit_fraction=args.fraction), "bench")}
    walls = {side: 0.0 for side in sides}
    latencies: dict[str, list[float]] = {side: [] for side in sides}
    in_rounds, drained_s = 0, 0.0
    for backend in sides.values():  # warm-up, untimed
        asyncio.run(closed_loop(backend, rounds[0][: 2 * args.concurrency], args.concurrency, "warm"))
        drain(backend)
    reference_before = sides["on"].stats()["audit"]["reference_seconds"]
    concluded_before = concluded(sides["on"])
    for i, requests in enumerate(rounds):
        for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
            backend = sides[side]
            for b in sides.values():  # every round starts from a cold prefix cache
                assert b.engine is not None
                b.engine.clear_prefix_cache()
            before = concluded(backend) if side == "on" else 0
            wall, lat = asyncio.run(closed_loop(backend, requests, args.concurrency, f"{side}{i}"))
            walls[side] += wall
            latencies[side] += lat
            if side == "on":
                in_rounds += concluded(backend) - before
                drained_s += drain(backend)
            print(f"round {i} audit {side:3}: {wall:6.2f} s, {len(requests) / wall:6.2f} req/s, "
                  f"p95 {p95(lat) * 1000:7.1f} ms")

    audit = sides["on"].stats()["audit"]
    total = args.rounds * args.requests
    throughput = {side: total / walls[side] for side in sides}
    tail = {side: p95(latencies[side]) for side in sides}
    median = {side: statistics.median(latencies[side]) for side in sides}
    for side in sides:
        print(f"audit {side:3}: {throughput[side]:6.2f} req/s, p50 {median[side] * 1000:7.1f} ms, "
              f"p95 {tail[side] * 1000:7.1f} ms")
    ratio = throughput["on"] / throughput["off"]
    growth = tail["on"] / tail["off"] - 1
    print(f"throughput on/off: {ratio:.3f} (target >= 0.97)  {'OK' if ratio >= 0.97 else 'MISSED'}")
    print(f"p95 on vs off: {growth:+.1%} (target <= +5%)  {'OK' if growth <= 0.05 else 'MISSED'}")
    audited = concluded(sides["on"]) - concluded_before
    reference = audit["reference_seconds"] - reference_before
    print(f"audit at {args.fraction}: {audited} requests audited ({in_rounds} inside the timed rounds, the "
          f"rest in {drained_s:.2f} s of idle time after them), {audit['mismatch']} mismatches, "
          f"{audit['skipped']} skipped; reference compute {reference:.2f} s = "
          f"{reference / walls['on']:.1%} of the audited side's timed wall")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for backend in sides.values():
        asyncio.run(backend.stop())


if __name__ == "__main__":
    main()

"""The prefix cache's effect: the same shuffled workload through the engine with the cache on and off,
side by side in one run (in-process EngineBackend, never a test).

    python -m benchmarks.prefix_cache [--states 20] [--sets 8] [--state-tokens 1500] [--concurrency 8]

Workload: ``--states`` states of about ``--state-tokens`` tokens, each asked ``--sets`` different question
sets of 1 to ``--questions`` questions (all types), in shuffled order, ``--concurrency`` clients in a closed
loop, on a Clef-shaped random release (hidden 256, 8 layers). Its 640-token test tokenizer spends ~200
tokens on one question's schema, about what Qwen's tokenizer spends on three, so one question per set is
the realistic proportion. Prints the prefill tokens each run computed and the floor (the fixed prefix once,
each state once, every schema), the throughput of each, the ratios (targets: on computes <= 25% of off,
throughput >= 2.5x), the cache's memory per cached token, and whether cached answers equal uncached ones.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from typing import Any

import torch

from benchmarks.shapes import add_tokenizer_argument
from clefserve.config import EngineConfig
from clefserve.engine.memory import MIB
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.testing.release import build_release, clef_shaped_spec
from clefserve.testing.tokenizer import WORDS


def make_state(decider: ClefDecider, tokens: int, rng: random.Random) -> dict:
    """A ticket whose record state is about ``tokens`` tokens long."""
    probe = {"model": "bench", "state": "", "questions": {"q": {"type": "noul", "instructions": "x"}}}
    words: list[str] = []
    state: dict = {}
    while True:
        state = {"ticket": rng.randint(1, 99999), "message": " ".join(words)}
        probe["state"] = state
        record = decider.encode(probe)
        if record.state_end - record.prefix_end >= tokens:
            return state
        words.extend(rng.choices(WORDS, k=32))


def question_set(rng: random.Random, most: int = 1) -> dict:
    def text(n: int) -> str:
        return " ".join(rng.choices(WORDS, k=n))

    out: dict[str, Any] = {}
    for j in range(rng.randint(1, most)):
        kind = rng.choice(["noul", "choice", "score"])
        if kind == "noul":
            out[f"q{j}"] = {"type": "noul", "instructions": f"Is the message about {text(2)}?"}
        elif kind == "choice":
            labels = rng.sample(WORDS, rng.randint(2, 4))
            out[f"q{j}"] = {"type": "choice", "instructions": f"Which {text(1)} fits?",
                            "criteria": {label: None for label in labels}}
        else:
            out[f"q{j}"] = {"type": "score", "instructions": f"How {text(1)} is it?",
                            "criteria": [text(1) for _ in range(rng.randint(2, 4))]}
    return out


async def run_workload(backend: EngineBackend, requests: list[dict], concurrency: int) -> list[dict]:
    async def connected() -> bool:
        return False

    results: list[Any] = [None] * len(requests)
    queue = list(enumerate(requests))

    async def client() -> None:  # closed loop: the next request when the last one is answered
        while queue:
            i, request = queue.pop(0)
            results[i] = await backend.decide(request, f"r{i}", connected)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--states", type=int, default=20)
    parser.add_argument("--sets", type=int, default=8, help="question sets per state")
    parser.add_argument("--state-tokens", type=int, default=1500)
    parser.add_argument("--questions", type=int, default=1, help="most questions in one set")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefix-cache-mb", type=int, default=512)
    add_tokenizer_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as folder:
        build_release(folder, clef_shaped_spec(args.hidden, args.layers, tokenizer=args.tokenizer), seed=0)
        decider = ClefDecider(folder)
    rng = random.Random(0)
    states = [make_state(decider, args.state_tokens, rng) for _ in range(args.states)]
    requests = [{"model": "bench", "state": state, "questions": question_set(rng, args.questions)}
                for state in states for _ in range(args.sets)]
    rng.shuffle(requests)
    records = [decider.encode(r) for r in requests]
    tokens = sum(len(r.input_ids) for r in records)
    state_tokens = sum(r.state_end - r.prefix_end for r in records) / len(records)
    # what no cache can avoid: the fixed prefix once, each distinct state once, every schema + suffix
    floor = records[0].prefix_end + sum(
        {r.input_ids[r.prefix_end : r.state_end]: r.state_end - r.prefix_end for r in records}.values()
    ) + sum(len(r.input_ids) - r.state_end for r in records)
    print(f"{args.states} states x {args.sets} question sets = {len(requests)} requests, shuffled; "
          f"{tokens} record tokens (state ~{state_tokens:.0f}, whole record ~{tokens / len(records):.0f}); "
          f"{args.concurrency} clients; hidden {args.hidden}, {args.layers} layers, "
          f"tokenizer {args.tokenizer}, {args.threads} thread(s)")

    base = dict(max_num_seqs=8, prefill_chunk_size=1024, block_size=16, kv_cache_mb=1024, max_queue=4096,
                raw_probabilities=True)
    runs: dict[str, tuple[float, dict, list[dict]]] = {}
    for label, on in (("off", False), ("on", True)):
        config = EngineConfig(**base, prefix_cache=on, prefix_cache_mb=args.prefix_cache_mb)
        backend = EngineBackend(decider, config, "bench")
        assert backend.engine is not None
        warm_up = {"model": "bench", "state": "warm up", "questions": question_set(random.Random(1))}
        asyncio.run(run_workload(backend, [warm_up], 1))
        backend.engine.clear_prefix_cache()
        before = backend.engine.stats()
        started = time.perf_counter()
        answers = asyncio.run(run_workload(backend, requests, args.concurrency))
        wall = time.perf_counter() - started
        stats = backend.engine.stats()
        asyncio.run(backend.stop())
        for key in ("prefix_computed_tokens", "prefix_hit_tokens"):
            stats[key] -= before[key]
        runs[label] = (wall, stats, answers)
        print(f"cache {label:3}: {wall:7.2f} s, {len(requests) / wall:6.2f} req/s, "
              f"{stats['prefix_computed_tokens']:8d} prefill tokens computed, "
              f"{stats['prefix_hit_tokens']:8d} served from the cache")

    (wall_off, off, answers_off), (wall_on, on, answers_on) = runs["off"], runs["on"]
    share = on["prefix_computed_tokens"] / off["prefix_computed_tokens"]
    speedup = wall_off / wall_on
    print(f"computed with the cache / without: {share:.1%} (target <= 25%)  "
          f"{'OK' if share <= 0.25 else 'MISSED'}; the floor is {floor / off['prefix_computed_tokens']:.1%} "
          f"({floor} tokens)")
    print(f"throughput with the cache / without: x{speedup:.2f} (target >= 2.5)  "
          f"{'OK' if speedup >= 2.5 else 'MISSED'}")
    cached_tokens = max(1, on["prefix_cached_tokens"])
    per_token = on["prefix_cache_bytes"] / cached_tokens / 1024
    print(f"cache memory at the end: {on['prefix_cache_bytes'] / MIB:.1f} MiB of "
          f"{on['prefix_cache_budget_bytes'] / MIB:.0f} MiB for {on['prefix_cached_tokens']} cached "
          f"positions and {on['prefix_entries']} snapshots = {per_token:.1f} KiB per cached token; "
          f"{on['prefix_evictions']} evictions")
    worst, flips = 0.0, 0
    for a, b in zip(answers_off, answers_on, strict=True):
        for qid, answer in a["answers"].items():
            other = b["answers"][qid]
            flips += answer.get("choice") != other.get("choice")
            raw = other["x_probabilities"]
            worst = max(worst, *(abs(p - raw[k]) for k, p in answer["x_probabilities"].items()))
    print(f"answers with the cache vs without: max |dp| = {worst:.2e}, {flips} different choices")


if __name__ == "__main__":
    main()

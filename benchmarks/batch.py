"""``clef-serve batch`` against the HTTP server, and batch's memory over a long input.

    python -m benchmarks.batch [--records 400] [--rss-lines 100000] [--threads 2]

1. Throughput on one workload: ``--records`` held-out support tickets of the embedded demo model's task
   (``clefserve.testing.triage``; the demo model, its default flags), or with ``--workload tiny`` short
   random tickets on a tiny random release (where the per-request cost of HTTP weighs most), answered
   a. by ``clef-serve batch`` (the engine in-process): records/s over its processing time, from its summary;
   b. by a ``clef-serve`` process with the same flags, called by the official ``typesafe-sdk`` client from 8
      threads (concurrency 8): records/s from the first request to the last answer.
   Model loading and the self-check are left out on both sides (the server is ready before the clock
   starts); the wall time of the whole batch command is printed too. Both use ``--threads`` torch threads.
2. Memory: ``clef-serve batch`` over ``--rss-lines`` lines (a tiny random release, ``--rss-states``
   distinct states asked one of four question sets, so most records come from the prefix cache and the
   run is about the batch machinery, not the model). The resident memory of the process is sampled every
   second and printed against the lines written. The KV pool and the prefix cache have fixed budgets
   (``--kv-cache-mb``, ``--prefix-cache-mb``): memory grows while they fill, then must stay flat.

Prints numbers only; run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from clefserve.testing.server_process import ROOT, ServerProcess
from clefserve.testing.tokenizer import WORDS

MIB = 1 << 20


def demo_tickets(count: int) -> list[dict[str, Any]]:
    from clefserve.testing.triage import generate

    return [{"id": f"T-{i}", **example.request} for i, example in enumerate(generate(count, 99, "heldout"))]


def write_jsonl(path: Path, bodies: list[dict[str, Any]]) -> Path:
    with path.open("w") as f:
        for body in bodies:
            f.write(json.dumps(body, ensure_ascii=False) + "\n")
    return path


def environment(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TYPESAFE_", "CLEF_"))}
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def batch_command(records: Path, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "clefserve.cli", "batch", str(records), "-o", str(out), "--quiet",
            "--log-level", "info", *flags]


def summary_of(stderr: str) -> dict[str, Any]:
    for line in stderr.splitlines():
        if line.startswith("{") and '"batch finished"' in line:
            return json.loads(line)["summary"]
    raise RuntimeError(f"no summary in batch's log:\n{stderr[-2000:]}")


def run_batch(records: Path, workdir: Path, threads: int, flags: list[str]) -> tuple[dict[str, Any], float]:
    out = workdir / "batch-answers.jsonl"
    start = time.perf_counter()
    done = subprocess.run(batch_command(records, out, *flags), cwd=ROOT, env=environment(threads),
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"clef-serve batch failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return summary_of(done.stderr), wall


def run_sdk(bodies: list[dict[str, Any]], workdir: Path, threads: int, flags: list[str],
            concurrency: int) -> tuple[float, int]:
    from typesafe_sdk import RetryPolicy, TypeSafeClient

    with ServerProcess(None, workdir / "server.log", *flags, threads=threads) as server, \
            TypeSafeClient(api_key="unused", base_url=server.url, retry=RetryPolicy(max_retries=0),
                           timeout=600) as client:
        client.system_one(state="warm-up", questions=bodies[0]["questions"], model=bodies[0]["model"])

        def ask(body: dict[str, Any]) -> int:
            result = client.system_one(state=body["state"], questions=body["questions"], model=body["model"])
            return result.usage.input_tokens

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(ask, bodies))
        return time.perf_counter() - start, tokens


def tiny_release(workdir: Path) -> Path:
    from clefserve.testing.release import ReleaseSpec, build_release

    spec = ReleaseSpec(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return build_release(workdir / "tiny", spec)


def tiny_tickets(count: int, seed: int = 5) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    questions = {
        "refund": {"type": "noul", "instructions": "refund?", "criteria": {"true": None, "false": None}},
        "team": {"type": "choice", "instructions": "team?",
                 "criteria": {"billing": None, "tech": None, "sales": None}},
    }
    return [{"id": f"T-{i}", "model": "m", "questions": questions,
             "state": {"ticket": i, "message": " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))}}
            for i in range(count)]


def throughput(args: argparse.Namespace, workdir: Path) -> None:
    flags = args.engine_args.split()
    if args.workload == "tiny":
        flags = ["--w", str(tiny_release(workdir)), *flags]
        bodies, what = tiny_tickets(args.records), "short random tickets, tiny random release"
    else:
        bodies, what = demo_tickets(args.records), "demo tickets, demo model"
    records = write_jsonl(workdir / "tickets.jsonl", bodies)
    print(f"throughput: {len(bodies)} {what}, {args.threads} torch threads, flags "
          f"{' '.join(flags) or '(defaults)'}", flush=True)
    sdk_wall, sdk_tokens = run_sdk(bodies, workdir, args.threads, flags, args.concurrency)
    sdk_rate = len(bodies) / sdk_wall
    print(f"  HTTP server + typesafe-sdk, concurrency {args.concurrency}: {sdk_rate:7.2f} records/s "
          f"{sdk_tokens / sdk_wall:9.0f} tokens/s  ({sdk_wall:.1f} s)", flush=True)
    summary, wall = run_batch(records, workdir, args.threads, flags)
    rate = summary["records_per_s"]
    tokens_per_s = summary["tokens_per_s"]
    print(f"  clef-serve batch (in-process engine):      {rate:7.2f} records/s {tokens_per_s:9.0f} "
          f"tokens/s  ({summary['elapsed_s']:.1f} s; {wall:.1f} s with loading and self-check; "
          f"{100 * summary['cached_share']:.1f}% cached)", flush=True)
    print(f"  batch / HTTP: {rate / sdk_rate:.2f}x", flush=True)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def long_input(path: Path, lines: int, states: int, seed: int) -> Path:
    rng = random.Random(seed)
    pool = [{"ticket": i, "message": " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))}
            for i in range(states)]
    question_sets = [
        {"refund": {"type": "noul", "instructions": "refund?", "criteria": {"true": None, "false": None}}},
        {"team": {"type": "choice", "criteria": {"billing": None, "tech": None, "sales": None}}},
        {"urgency": {"type": "score", "criteria": ["later", "today", "now"]}},
        {"spam": {"type": "noul", "criteria": {"true": None, "false": None}}},
    ]
    with path.open("w") as f:
        for i in range(lines):
            body = {"id": f"L-{i}", "model": "m", "state": rng.choice(pool),
                    "questions": rng.choice(question_sets)}
            f.write(json.dumps(body) + "\n")
    return path


def memory(args: argparse.Namespace, workdir: Path) -> None:
    release = tiny_release(workdir)
    records = long_input(workdir / "long.jsonl", args.rss_lines, args.rss_states, seed=1)
    out = workdir / "long-answers.jsonl"
    flags = ["--w", str(release), "--max-num-seqs", "16", "--kv-cache-mb", str(args.kv_cache_mb),
             "--prefix-cache-mb", str(args.prefix_cache_mb)]
    size = records.stat().st_size / MIB
    print(f"memory: {args.rss_lines:,} lines ({size:.0f} MiB), {args.rss_states} states x 4 question "
          f"sets, tiny release, {' '.join(flags[2:])}", flush=True)
    log = (workdir / "long.log").open("wb")
    process = subprocess.Popen(batch_command(records, out, *flags), cwd=ROOT, env=environment(args.threads),
                               stdout=log, stderr=subprocess.STDOUT)
    samples: list[tuple[float, int, int]] = []
    start = time.perf_counter()
    while process.poll() is None:
        try:
            rss = rss_bytes(process.pid)
        except OSError:
            break
        written = out.read_bytes().count(b"\n") if out.exists() else 0
        samples.append((time.perf_counter() - start, written, rss))
        time.sleep(1.0)
    log.close()
    if process.returncode != 0:
        raise RuntimeError(f"batch failed:\n{(workdir / 'long.log').read_text()[-3000:]}")
    summary = summary_of((workdir / "long.log").read_text())
    running = [s for s in samples if s[1] > 0]
    print(f"  {summary['answered']:,} answered in {summary['elapsed_s']:.0f} s "
          f"({summary['records_per_s']:.0f} records/s, "
          f"{100 * summary['cached_share']:.0f}% of tokens cached)")
    print("  lines written   RSS MiB")
    for fraction in (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        target = fraction * args.rss_lines
        sample = next((s for s in running if s[1] >= target), running[-1] if running else None)
        if sample is not None:
            print(f"  {sample[1]:>13,}   {sample[2] / MIB:7.1f}")
    if running:
        tenth = next(s for s in running if s[1] >= 0.1 * args.rss_lines)
        peak_after = max(s[2] for s in running if s[1] >= tenth[1])
        print(f"  RSS at 10% of the lines {tenth[2] / MIB:.1f} MiB, highest after it "
              f"{peak_after / MIB:.1f} MiB ({100 * (peak_after / tenth[2] - 1):+.1f}%)", flush=True)


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--records", type=int, default=400, help="tickets for the throughput comparison")
    parser.add_argument("--workload", choices=["demo", "tiny"], default="demo")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    parser.add_argument("--engine-args", default="", help="extra engine flags for both sides")
    parser.add_argument("--rss-lines", type=int, default=100_000)
    parser.add_argument("--rss-states", type=int, default=1000)
    parser.add_argument("--kv-cache-mb", type=int, default=64)
    parser.add_argument("--prefix-cache-mb", type=int, default=64)
    parser.add_argument("--skip", choices=["throughput", "memory"], action="append", default=[])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="clef-bench-batch-") as tmp:
        workdir = Path(tmp)
        if "throughput" not in args.skip:
            throughput(args, workdir)
        if "memory" not in args.skip:
            memory(args, workdir)


if __name__ == "__main__":
    main()

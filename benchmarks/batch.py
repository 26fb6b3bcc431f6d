"""``clef-serve batch`` against the HTTP server, and batch's memory over a long input.

    python -m benchmarks.batch [--workload dataset|demo|tiny] [--records N] [--rss-lines 100000] [--threads 2]

1. Throughput on one workload, answered
   a. by ``clef-serve batch`` (the engine in-process): records/s over its processing time, from its summary;
   b. by a ``clef-serve`` process with the same flags, called by the official ``typesafe-sdk`` client from 8
      threads (concurrency 8): records/s from the first request to the last answer.
   The workloads:
   ``dataset`` (default): the batch tests' file (``clefserve.testing.batch_workload``, 2,000 records): short
      records whose states repeat, 3% malformed lines, lines over ``--max-body-bytes``, schemas over
      ``--max-length``, on the tests' tiny random release and engine flags. The client sends every line that
      is a JSON object (errors come back as errors) and counts the others as errors without a request;
   ``demo``: 400 held-out support tickets of the embedded demo model's task (``clefserve.testing.triage``;
      the demo model, its default flags), unique states of ~450 tokens;
   ``tiny``: 400 short random tickets with unique states on a tiny random release.
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
import statistics
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
    """(``--log-level info`` comes last, over any level in ``flags``: the summary is read from the log)"""
    return [sys.executable, "-m", "clefserve.cli", "batch", str(records), "-o", str(out), *flags, "--quiet",
            "--log-level", "info"]


def summary_of(stderr: str) -> dict[str, Any]:
    for line in stderr.splitlines():
        if line.startswith("{") and '"batch finished"' in line:
            return json.loads(line)["summary"]
    raise RuntimeError(f"no summary in batch's log:\n{stderr[-2000:]}")


def run_batch(records: Path, workdir: Path, threads: int, flags: list[str]) -> tuple[dict[str, Any], float]:
    out = workdir / "batch-answers.jsonl"
    out.unlink(missing_ok=True)  # or batch would resume the last round's run and skip every record
    start = time.perf_counter()
    done = subprocess.run(batch_command(records, out, *flags), cwd=ROOT, env=environment(threads),
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"clef-serve batch failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return summary_of(done.stderr), wall


def request_bodies(lines: list[bytes]) -> list[dict[str, Any] | None]:
    """What a client holds for each input line: the JSON object, or None where the line is not one."""
    bodies: list[dict[str, Any] | None] = []
    for line in lines:
        try:
            body = json.loads(line)
        except ValueError:
            body = None
        bodies.append(body if isinstance(body, dict) else None)
    return bodies


def run_sdk(bodies: list[dict[str, Any] | None], workdir: Path, threads: int, flags: list[str],
            concurrency: int) -> tuple[float, int, int]:
    """(seconds from the first request to the last answer, input tokens answered, records in error)."""
    from typesafe_sdk import RetryPolicy, TypeSafeClient

    first = next(body for body in bodies if body is not None and "questions" in body)
    with ServerProcess(None, workdir / "server.log", *flags, threads=threads) as server, \
            TypeSafeClient(api_key="unused", base_url=server.url, retry=RetryPolicy(max_retries=0),
                           timeout=600) as client:
        client.system_one(state="warm-up", questions=first["questions"], model=first["model"])

        def ask(body: dict[str, Any] | None) -> int | None:
            if body is None:
                return None
            try:
                result = client.system_one(state=body.get("state"), questions=body.get("questions"),
                                           model=body.get("model"))
            except Exception:  # the record's error, as batch writes it
                return None
            return result.usage.input_tokens

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            answered = list(pool.map(ask, bodies))
        tokens = sum(t for t in answered if t is not None)
        return time.perf_counter() - start, tokens, answered.count(None)


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


def dataset_release(workdir: Path) -> Path:
    from clefserve.testing.batch_workload import BATCH_SPEC
    from clefserve.testing.release import build_release

    return build_release(workdir / "dataset", BATCH_SPEC, seed=31)


def workload(args: argparse.Namespace, workdir: Path) -> tuple[Path, list[str], str]:
    """(the JSONL input, both sides' engine flags, a description)."""
    from clefserve.testing.batch_workload import ENGINE_FLAGS, make_workload

    flags = args.engine_args.split()
    records = workdir / "records.jsonl"
    if args.workload == "dataset":
        work = make_workload(args.records or 2000, seed=7)
        work.write(records)
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(work.kinds.items()))
        return records, ["--w", str(dataset_release(workdir)), *ENGINE_FLAGS, *flags], \
            f"lines of the batch tests' file ({kinds}), tiny random release"
    if args.workload == "tiny":
        write_jsonl(records, tiny_tickets(args.records or 400))
        release = tiny_release(workdir)
        return records, ["--w", str(release), *flags], "short random tickets, tiny random release"
    write_jsonl(records, demo_tickets(args.records or 400))
    return records, flags, "demo tickets, demo model"


def throughput(args: argparse.Namespace, workdir: Path) -> None:
    records, flags, what = workload(args, workdir)
    bodies = request_bodies(records.read_bytes().splitlines())
    print(f"throughput: {len(bodies)} {what}; {args.threads} torch threads, flags "
          f"{' '.join(flags) or '(defaults)'}; {args.rounds} rounds, the side that goes first alternates",
          flush=True)
    ratios = []
    for round_number in range(args.rounds):
        rates: dict[str, float] = {}
        for side in ("http", "batch") if round_number % 2 == 0 else ("batch", "http"):
            if side == "http":
                wall, tokens, errors = run_sdk(bodies, workdir, args.threads, flags, args.concurrency)
                rates[side] = len(bodies) / wall
                print(f"  HTTP server + typesafe-sdk, concurrency {args.concurrency}: {rates[side]:7.2f} "
                      f"records/s {tokens / wall:9.0f} tokens/s  ({wall:.1f} s; {errors} errors)", flush=True)
            else:
                summary, wall = run_batch(records, workdir, args.threads, flags)
                rates[side] = summary["records_per_s"]
                print(f"  clef-serve batch (in-process engine):      {rates[side]:7.2f} records/s "
                      f"{summary['tokens_per_s']:9.0f} tokens/s  ({summary['elapsed_s']:.1f} s; {wall:.1f} s "
                      f"with loading and self-check; {100 * summary['cached_share']:.1f}% cached; "
                      f"{summary['errors']} errors)", flush=True)
        ratios.append(rates["batch"] / rates["http"])
        print(f"  round {round_number + 1}: batch / HTTP {ratios[-1]:.2f}x", flush=True)
    print(f"  batch / HTTP over {len(ratios)} rounds: median {statistics.median(ratios):.2f}x, "
          f"{', '.join(f'{r:.2f}' for r in ratios)}", flush=True)


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
    parser.add_argument("--workload", choices=["dataset", "demo", "tiny"], default="dataset")
    parser.add_argument("--records", type=int, help="records of the workload (2,000 dataset, 400 others)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds, HTTP and batch in each")
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

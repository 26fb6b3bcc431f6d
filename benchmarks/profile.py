"""Where the server's time goes: a real workload through the HTTP server, with the share of wall time spent in
each part of the work.

    python -m benchmarks.profile [--dtype f32] [--concurrency 8] [--requests 8] [--shape clef256] [--d 0]

The server (FastAPI + engine + Clef head) runs in this process on a loopback port; a separate client process
sends the workload (half ~``--short``-token and half ~``--long``-token records with fresh states, as
``benchmarks.systemone``) with ``--concurrency`` requests in flight. Timers wrap each part:

- engine thread: projection/MLP GEMMs (``Linear``), attention, the delta rule, the causal conv, norms and
  rotary, the rest of the layer work (gates, activations, residual adds, K/V and state copies), the decision
  head and answer shaping, scheduler bookkeeping, and idle (waiting for work);
- request side: record encoding (worker threads) and the event loop's CPU time (HTTP, JSON, validation).

The live audit is off here (it swaps the reference ops onto the model in idle time, which would both undo
the op timers and add reference compute to the profile); ``benchmarks.audit`` measures its cost.

Shares are of the measured wall time. The engine thread's parts add up to 100%; the request side runs on
other threads, concurrently (on a 2-core machine it takes cores from the engine). With CPU lanes
(``--cpu-lanes 2``, the server's default; ``clefserve.engine.lanes``) the engine has two worker threads: the
parts are then summed over both and their shares are of twice the wall time, so they still add up to 100%
(a lane waiting for a step beside the other's counts as idle). Op timers synchronise
CUDA when the model runs there, so a GPU profile shows where launches wait.

As the server does once its model is loaded, the process's objects are frozen out of the garbage collector's
passes after the warm-up (``clefserve.engine.python_heap``). Collections still run for what the workload
allocates; each stops every thread while it holds the GIL, and the last line says how many there were, per
generation, and how long they held it.

``--ops N`` looks below the parts: ``torch.profiler`` records the engine thread's aten ops during the run
and the N that took the most CPU time are printed with their input shapes (kineto may print an "External
init callback" line when it starts on that thread; the recording works all the same). The recording is
not free: it slows the parts it records (the delta rule 8.4 against 7.0 ms a call in one bf16 run) and its
events are Python objects, which make the collector run full passes it otherwise does not (two of ~36 ms
in a 16-request run, none without). Take the parts and the collector's line from a run without ``--ops``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from clefserve.config import DTYPES, EngineConfig
from clefserve.model import layers
from clefserve.testing.server_process import free_port

ENGINE_PARTS = ("GEMMs (projections, MLP)", "attention", "delta rule", "causal conv", "norms + rotary",
                "other layer work", "decision head + answers", "scheduler + bookkeeping", "idle + untimed")
OP_PARTS = {"causal_attention": "attention", "gated_delta_rule": "delta rule", "causal_conv1d": "causal conv",
            "rms_norm": "norms + rotary", "gated_rms_norm": "norms + rotary", "rope_tables": "norms + rotary",
            "apply_rope": "norms + rotary"}


class Timers:
    """Wall seconds per part; nested timers count only in the innermost part (``exclusive``)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.sync = sync
        self._local = threading.local()
        self._lock = threading.Lock()  # the engine's lanes time their parts side by side

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        self.sync()
        start = time.perf_counter()
        stack.append(0.0)
        try:
            yield
        finally:
            self.sync()
            elapsed = time.perf_counter() - start
            inner = stack.pop()
            with self._lock:
                self.seconds[name] += elapsed - inner
            if stack:
                stack[-1] += elapsed

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls[name] += 1
            with self.part(name):
                return fn(*args, **kwargs)

        # the delta rule's entry point for steps with prefix-cache snapshots inside a piece: without it the
        # layer would take its two-call fallback, and the profile would time a path the server never runs
        keeping = getattr(fn, "keeping", None)
        if keeping is not None:
            timed.keeping = self.wrap(name, keeping)  # type: ignore[attr-defined]
        return timed


def collector_summary(before: list[tuple[int, float]], after: list[tuple[int, float]]) -> str:
    """The garbage collector's passes between two :meth:`CollectorPauses.totals`, per generation."""
    passes = ", ".join(f"gen{g} {n1 - n0} ({1e3 * (t1 - t0):.1f} ms)"
                       for g, ((n0, t0), (n1, t1)) in enumerate(zip(before, after, strict=True)))
    return f"garbage collection (every thread stops): {passes}"


def instrument(backend: Any, timers: Timers) -> None:
    """Wrap the engine's parts of ``backend`` (an EngineBackend) with ``timers``."""
    engine, decider = backend.engine, backend.decider
    model = decider.backbone
    ops = model.ops
    model.set_ops(dataclasses.replace(
        ops, **{field: timers.wrap(part, getattr(ops, field)) for field, part in OP_PARTS.items()}))
    layers.Linear.forward = timers.wrap(ENGINE_PARTS[0], layers.Linear.forward)
    engine.runner.run = timers.wrap("other layer work", engine.runner.run)
    engine.runner.prepare = timers.wrap("scheduler + bookkeeping", engine.runner.prepare)
    engine.finish = timers.wrap("decision head + answers", engine.finish)
    for name in ("schedule", "complete"):
        setattr(engine.scheduler, name, timers.wrap("scheduler + bookkeeping",
                                                    getattr(engine.scheduler, name)))
    decider.encode = timers.wrap("record encoding", decider.encode)


class EngineOps:
    """``torch.profiler`` on the engine thread: the aten ops, with their input shapes, that take its time."""

    def __init__(self, engine: Any) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.engine = engine
        self.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)

    def __enter__(self) -> EngineOps:
        self.engine.on_engine_thread(self.profiler.start)
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.on_engine_thread(self.profiler.stop)

    def table(self, rows: int) -> str:
        averages = self.profiler.key_averages(group_by_input_shape=True)
        return averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=44,
                              max_shapes_column_width=90)


def serve_in_thread(backend: Any, config: EngineConfig) -> tuple[Any, threading.Thread, dict]:
    import uvicorn

    from clefserve.server import create_app

    app = create_app(backend, config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.port, log_config=None,
                                           access_log=False, log_level="warning"))
    loop_info: dict[str, Any] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        loop_info["loop"] = loop
        loop.run_until_complete(server.serve())

    thread = threading.Thread(target=run, name="http", daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, loop_info


def loop_cpu_seconds(loop: asyncio.AbstractEventLoop) -> float:
    """CPU seconds used so far by the thread that runs ``loop``."""
    done = threading.Event()
    box: dict[str, float] = {}

    def read() -> None:
        box["t"] = time.thread_time()
        done.set()

    loop.call_soon_threadsafe(read)
    done.wait(10)
    return box["t"]


CLIENT = """
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
import httpx
url, concurrency = sys.argv[1], int(sys.argv[2])
requests = json.load(sys.stdin)
with httpx.Client(base_url=url, timeout=600) as client:
    def call(body):
        t = time.perf_counter()
        r = client.post("/v1/systemone", json=body)
        r.raise_for_status()
        return time.perf_counter() - t
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(call, requests))
    print(json.dumps({"wall": time.perf_counter() - start, "latencies": latencies}))
"""


def run_client(url: str, requests: list[dict], concurrency: int) -> dict:
    result = subprocess.run([sys.executable, "-c", CLIENT, url, str(concurrency)], input=json.dumps(requests),
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.shapes import SHAPES, add_tokenizer_argument, build_shape
    from benchmarks.workload import make_request
    from clefserve.engine.openmp import release_thread_team
    from clefserve.engine.python_heap import collector_pauses, freeze_loaded_objects
    from clefserve.formats.clef import ClefDecider
    from clefserve.formats.clef.engine_backend import EngineBackend

    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8, help="requests in the workload (half short)")
    parser.add_argument("--short", type=int, default=400)
    parser.add_argument("--long", type=int, default=3000)
    parser.add_argument("--shape", default="clef256", choices=sorted(SHAPES))
    parser.add_argument("--w", metavar="DIR", help="profile this release folder instead of a built shape "
                                                  "(for example clefserve/demo)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--prefill-chunk-size", type=int, default=1024)
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--cpu-lanes", type=int, choices=(1, 2), default=EngineConfig.cpu_lanes,
                        help="as the server's flag (default: %(default)s)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "fast", "reference"))
    parser.add_argument("--d", "--device", dest="device", default="cpu",
                        help="cpu (default) or a GPU index, as the server's --d")
    parser.add_argument("--ops", type=int, default=0, metavar="N",
                        help="also print the N aten ops (by input shapes) that took the most of the engine "
                             "thread's CPU time (the first lane's, with two), from torch.profiler; its "
                             "overhead then adds to the parts")
    add_tokenizer_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import random

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.w) if args.w else build_shape(args.shape, Path(tmp) / "release",
                                                                   tokenizer=args.tokenizer)
        config = EngineConfig(device=args.device, dtype=args.dtype, port=free_port(),
                              max_num_seqs=args.max_num_seqs,
                              prefill_chunk_size=args.prefill_chunk_size, kv_cache_mb=1024,
                              prefix_cache=not args.no_prefix_cache, audit_fraction=0.0,
                              cpu_lanes=args.cpu_lanes)
        decider = ClefDecider(folder, DTYPES[args.dtype], config.torch_device, kernels=args.kernels)
        backend = EngineBackend(decider, config, "bench")
        server, thread, loop_info = serve_in_thread(backend, config)
        url = f"http://127.0.0.1:{config.port}"
        rng = random.Random(0)
        lengths = [args.long if i % 2 else args.short for i in range(args.requests)]
        warm = [make_request(decider.encoder, args.short, rng), make_request(decider.encoder, args.long, rng)]
        requests = [make_request(decider.encoder, n, rng) for n in lengths]
        rng.shuffle(requests)
        release_thread_team()  # this thread's torch work is done (as the server's loading thread does)
        run_client(url, warm, 2)
        freeze_loaded_objects()  # as the server does once loaded

        timers = Timers(torch.cuda.synchronize if decider.backbone.device.type == "cuda" else lambda: None)
        instrument(backend, timers)
        loop = loop_info["loop"]
        loop_before = loop_cpu_seconds(loop)
        stats_before = backend.engine.stats()
        collector_pauses.install()
        collections_before = collector_pauses.totals()
        with EngineOps(backend.engine) if args.ops else nullcontext() as ops:
            result = run_client(url, requests, args.concurrency)
        collections = collector_summary(collections_before, collector_pauses.totals())
        loop_cpu = loop_cpu_seconds(loop) - loop_before
        stats = backend.engine.stats()
        server.should_exit = True
        thread.join(30)

    untimed = [part for part in ("delta rule", "norms + rotary") if not timers.calls[part]]
    if untimed and stats["steps"] > stats_before["steps"]:
        raise SystemExit(f"the op timers of {', '.join(untimed)} never ran: something replaced the model's "
                         "ops after they were instrumented, so these shares would be wrong")
    wall = result["wall"]
    lanes = len(backend.engine.lanes)
    seconds = dict(timers.seconds)
    busy = sum(seconds.get(p, 0.0) for p in ENGINE_PARTS[:-1])
    seconds["idle + untimed"] = max(0.0, lanes * wall - busy)
    tokens = stats["prefill_tokens"] - stats_before["prefill_tokens"]
    latencies = sorted(result["latencies"])
    model = args.w or f"shape {args.shape}, tokenizer {args.tokenizer}"
    print(f"# {model}, {decider.backbone.device}, {args.dtype}, kernels {args.kernels} "
          f"({decider.backbone.ops.name}), "
          f"{args.threads} threads, concurrency {args.concurrency}, "
          f"{args.requests} requests (~{args.short}/~{args.long} tokens), chunk {args.prefill_chunk_size}, "
          f"prefix cache {'off' if args.no_prefix_cache else 'on'}, {lanes} lane(s)")
    print(f"wall {wall:.2f} s, {len(latencies) / wall:.2f} req/s, {tokens / wall:.0f} computed tok/s, "
          f"p50 {latencies[len(latencies) // 2]:.2f} s, steps {stats['steps'] - stats_before['steps']} "
          f"({stats['side_steps'] - stats_before['side_steps']} on the second lane)")
    title = "engine thread" if lanes == 1 else f"engine lanes ({lanes} x wall)"
    print(f"{title:<28} {'seconds':>8} {'share':>7} {'calls':>7} {'ms/call':>8}")
    for part in ENGINE_PARTS:
        spent, calls = seconds.get(part, 0.0), timers.calls.get(part, 0)
        per_call = f" {calls:7d} {1e3 * spent / calls:8.3f}" if calls else ""
        print(f"  {part:<26} {spent:8.3f} {100 * spent / (lanes * wall):6.1f}%{per_call}")
    print(f"{'request side (other threads)':<28}")
    for part, value in (("record encoding", seconds.get("record encoding", 0.0)),
                        ("HTTP + JSON (event loop CPU)", loop_cpu)):
        print(f"  {part:<26} {value:8.3f} {100 * value / wall:6.1f}%")
    print(collections)
    if ops is not None:
        print(f"engine thread, the {args.ops} costliest aten ops (self CPU time)")
        print(ops.table(args.ops))


if __name__ == "__main__":
    main()

"""The benchmark workload: System One requests whose records have a given token count, a closed loop of
clients that keeps an engine busy with records, and the rounds of engine benchmarks built on it."""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from benchmarks.heap import add_heap_argument, prepare_heap
from benchmarks.shapes import SHAPES, add_tokenizer_argument, build_shape
from clefserve.config import DTYPES, EngineConfig
from clefserve.engine import Engine
from clefserve.engine.openmp import release_thread_team
from clefserve.formats.clef.encoder import ClefEncoder
from clefserve.model.backbone import Backbone
from clefserve.model.weights import load_backbone
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
    request: dict = {"model": "bench", "state": "", "questions": questions}
    ticket = rng.randint(1, 99999)

    def length(words: list[str]) -> int:
        request["state"] = {"ticket": ticket, "message": " ".join(words)}
        return len(encoder.encode(request).input_ids)

    words = rng.choices(WORDS, k=64)
    while length(words) < tokens:
        words += rng.choices(WORDS, k=len(words))
    low, high = 0, len(words)  # the fewest words that reach ``tokens``
    while low < high:
        middle = (low + high) // 2
        if length(words[:middle]) >= tokens:
            high = middle
        else:
            low = middle + 1
    length(words[:low])
    return request


def closed_loop(submit: Callable[[Any], Future], records: list, concurrency: int) -> float:
    """Wall seconds for ``concurrency`` clients to get every record answered, each sending its next record
    when its last is answered (``submit``: for example ``Engine.submit``)."""
    return timed_closed_loop(submit, records, concurrency)[0]


def timed_closed_loop(submit: Callable[[Any], Future], records: list, concurrency: int,
                      prepare: Callable[[Any], None] | None = None) -> tuple[float, list[float]]:
    """:func:`closed_loop` that also gives each record's latency (in ``records``' order; the records go out
    in that order, so the first ``concurrency`` are the opening burst). ``prepare(record)`` runs on the
    client before it submits the record and counts in its latency (a request's encoding, say)."""
    queue, lock = deque(enumerate(records)), threading.Lock()
    latencies = [0.0] * len(records)

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                index, record = queue.popleft()
            sent = time.perf_counter()
            if prepare is not None:
                prepare(record)
            submit(record).result()
            latencies[index] = time.perf_counter() - sent

    clients = [threading.Thread(target=client) for _ in range(concurrency)]
    started = time.perf_counter()
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    return time.perf_counter() - started, latencies


def add_engine_round_arguments(parser: argparse.ArgumentParser, short: int = 400) -> None:
    """The options of a benchmark that sends rounds of fresh mixed records straight to an engine
    (``benchmarks.lanes``, ``benchmarks.short_latency``)."""
    parser.add_argument("--shape", default="clef256", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--records", type=int, default=16, help="records per round (half short)")
    parser.add_argument("--short", type=int, default=short)
    parser.add_argument("--long", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prefill-chunk-size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_tokenizer_argument(parser)
    add_heap_argument(parser)


def round_backbone(args: argparse.Namespace) -> tuple[Backbone, str]:
    """The options' threads and heap for this process, and the shape's backbone built in a temporary
    folder; returns it and the heap's description."""
    torch.set_num_threads(args.threads)
    heap = prepare_heap(args.heap)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_shape(args.shape, Path(tmp) / "release", tokenizer=args.tokenizer)
        model = load_backbone(folder, dtype=DTYPES[args.dtype])
    release_thread_team()  # as the server's loading thread does: only the engines' teams remain
    return model, heap


def round_engine(model: Backbone, args: argparse.Namespace, cpu_lanes: int) -> Engine:
    """An engine for one round (no head, no prefix cache, no audit), warmed up."""
    config = EngineConfig(dtype=args.dtype, max_num_seqs=args.concurrency,
                          prefill_chunk_size=args.prefill_chunk_size, kv_cache_mb=512, max_queue=4096,
                          prefix_cache=False, audit_fraction=0.0, cpu_lanes=cpu_lanes)
    engine = Engine(model, config, lambda finished: [None] * len(finished))
    engine.submit(torch.zeros(64, dtype=torch.long)).result()
    return engine

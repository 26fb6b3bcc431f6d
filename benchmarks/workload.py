"""The benchmark workload: System One requests whose records have a given token count, and a closed loop of
clients that keeps an engine busy with records."""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from clefserve.formats.clef.encoder import ClefEncoder
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

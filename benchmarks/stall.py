"""How long the server's other work waits while one request's record is tokenized.

    python -m benchmarks.stall [--shape clef256] [--dtype bf16] [--state-bytes 1000000] [--rounds 3]

A real clef-serve process on 127.0.0.1 with a random release. Each round, one client polls ``/health``
every 2 ms while another sends a request whose state is ``--state-bytes`` of text (the encoder cuts it to
``--max-length`` tokens after tokenizing all of it). Printed per round: the time of the big request, and the
longest and median ``/health`` round trip while it was in flight. A tokenizer that holds the GIL for the
whole call stops the event loop for as long (``Tokenizer.encode``: 552-670 ms for a 1 MB state with
Qwen3.5's tokenizer); one that lets go of it leaves the probes at a few milliseconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.shapes import SHAPES, add_tokenizer_argument, build_shape
from benchmarks.workload import make_request
from clefserve.config import DTYPES
from clefserve.formats.clef.encoder import ClefEncoder
from clefserve.testing.server_process import ServerProcess
from clefserve.testing.tokenizer import WORDS

POLL_INTERVAL_S = 0.002


def probe_while(url: str, work: threading.Thread) -> list[float]:
    """``/health`` round trips, one every ``POLL_INTERVAL_S``, from before ``work`` starts until it ends."""
    times: list[float] = []
    with httpx.Client(base_url=url, timeout=60) as client:
        client.get("/health").raise_for_status()
        work.start()
        while work.is_alive():
            started = time.perf_counter()
            client.get("/health").raise_for_status()
            times.append(time.perf_counter() - started)
            time.sleep(POLL_INTERVAL_S)
    work.join()
    return times


def send(url: str, body: dict, outcome: dict[str, float]) -> None:
    """POST ``body`` and note its status and seconds in ``outcome``."""
    with httpx.Client(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        response = client.post("/v1/systemone", json=body)
        outcome["status"] = response.status_code
        outcome["seconds"] = time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="clef256", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--state-bytes", type=int, default=1_000_000,
                        help="text in the big request's state (the server's --max-body-bytes is raised "
                             "to fit)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    add_tokenizer_argument(parser)
    args = parser.parse_args(argv)

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_shape(args.shape, Path(tmp) / "release", tokenizer=args.tokenizer)
        encoder = ClefEncoder.from_folder(folder)
        state = " ".join(rng.choices(WORDS, k=args.state_bytes // 4))[: args.state_bytes]
        big = {"model": "bench", "state": state, "questions": {"q": {"type": "noul"}}}
        body_limit = str(max(1 << 20, 2 * args.state_bytes))
        print(f"# shape {args.shape}, tokenizer {args.tokenizer}, {args.dtype}, {args.threads} threads; "
              f"a state of {len(state):,} characters")
        with ServerProcess(folder, Path(tmp) / "server.log", "--dtype", args.dtype, "--max-body-bytes",
                           body_limit, threads=args.threads) as server, \
                httpx.Client(base_url=server.url, timeout=600) as client:
            client.post("/v1/systemone", json=make_request(encoder, 400, rng)).raise_for_status()
            for round_number in range(args.rounds):
                outcome: dict[str, float] = {}
                sender = threading.Thread(target=send, args=(server.url, big, outcome))
                probes = probe_while(server.url, sender)
                print(f"round {round_number}: big request {outcome['status']:.0f} in "
                      f"{outcome['seconds'] * 1e3:.0f} ms; /health longest {max(probes) * 1e3:.1f} ms, "
                      f"median {statistics.median(probes) * 1e3:.1f} ms over {len(probes)} probes")

if __name__ == "__main__":
    main()

"""SIGTERM on a real clef-serve process: in-flight requests finish, new connections are refused, exit 0."""

from __future__ import annotations

import random
import signal
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from clefserve.testing.server_process import ServerProcess
from clefserve.testing.tokenizer import WORDS

# Slow on purpose: 16 tokens per engine step, two sequences at a time, ~1,200-token records.
SLOW = ("--max-num-seqs", "2", "--prefill-chunk-size", "16", "--kv-cache-mb", "16")
IN_FLIGHT = 6


def long_body(seed: int, words: int = 1000) -> dict[str, Any]:
    rng = random.Random(seed)
    return {"model": "m", "state": " ".join(rng.choices(WORDS, k=words)),
            "questions": {"q": {"type": "noul", "instructions": "Is it long?"},
                          "team": {"type": "choice", "criteria": {"a": None, "b": "bee"}}}}


def engine_gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("clef_engine_") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_in_engine(url: str, count: int, futures: list[Future], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        g = engine_gauges(url)
        if g["clef_engine_running_sequences"] + g["clef_engine_waiting_sequences"] >= count:
            return
        assert not any(f.done() for f in futures), "a slow request finished before all were in flight"
        time.sleep(0.02)
    raise AssertionError(f"{count} requests never were in the engine at once")


def refused(port: int) -> bool:
    """Whether the port no longer takes connections. A connect racing the listening socket's close is reset
    rather than refused (the kernel had queued it on the socket being closed): that too is a refusal."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except (ConnectionRefusedError, ConnectionResetError):
        return True


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/systemone", json=body, timeout=120)


def test_sigterm_lets_in_flight_requests_finish_then_exits_0(make_release, tmp_path: Path) -> None:
    server = ServerProcess(make_release(seed=0), tmp_path / "server.log", *SLOW, "--shutdown-grace-s", "60")
    with server, ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = [pool.submit(post, server.url, long_body(i)) for i in range(IN_FLIGHT)]
        wait_in_engine(server.url, IN_FLIGHT, futures)
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not refused(server.port):  # uvicorn notices the signal on its next tick (0.1 s)
            assert time.monotonic() < deadline, "still accepting connections 5 s after SIGTERM"
            time.sleep(0.05)
        assert not all(f.done() for f in futures), "the requests finished before the port closed"
        responses = [f.result(timeout=120) for f in futures]
        assert refused(server.port)
        code = server.process.wait(60)
    assert [r.status_code for r in responses] == [200] * IN_FLIGHT, [r.text for r in responses]
    assert all(set(r.json()["answers"]) == {"q", "team"} for r in responses)
    assert code == 0, server.log.read_text()[-3000:]
    log = server.log.read_text()
    assert "engine stopped" in log and "clef-serve stopped" in log


def test_sigterm_past_the_grace_period_cuts_requests_and_still_exits_0(make_release, tmp_path: Path) -> None:
    server = ServerProcess(make_release(seed=0), tmp_path / "server.log", *SLOW, "--shutdown-grace-s", "0.5")
    with server, ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = [pool.submit(post, server.url, long_body(i, words=3000)) for i in range(IN_FLIGHT)]
        wait_in_engine(server.url, IN_FLIGHT, futures)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(30)
        took = time.monotonic() - started
        responses = [f.result(timeout=30) for f in futures]
        outcomes = [r.status_code for r in responses]
    for r in responses:
        if r.status_code == 503:
            assert r.json()["detail"]["error_type"] == "unavailable"
            assert r.headers["retry-after"] == "1" and r.headers["x-request-id"]
    assert code == 0, server.log.read_text()[-3000:]
    assert took < 10
    # cut off: a JSON 503 that clients retry, never uvicorn's plain-text 500
    assert 503 in outcomes and set(outcomes) <= {200, 503}, outcomes
    assert "timeout graceful shutdown exceeded" in server.log.read_text()


@pytest.mark.parametrize("flag", [[], ["--shutdown-grace-s", "5"]])
def test_shutdown_grace_flag(flag: list[str]) -> None:
    from clefserve.cli import build_parser
    from clefserve.config import EngineConfig

    args = build_parser().parse_args(["serve", "--w", "x", *flag])
    assert EngineConfig.from_args(args).shutdown_grace_s == (float(flag[1]) if flag else 30.0)

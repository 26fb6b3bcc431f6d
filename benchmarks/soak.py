"""Bounded load and soak test: a real clef-serve process on 127.0.0.1, a random release, a mixed workload.

    python -m benchmarks.soak [--requests 2000] [--concurrency 32] [--malformed 0.05] [--disconnects 0.05]

Phases:

1. soak: warm-up, then ``--requests`` requests at ``--concurrency``: valid bodies (short and long states,
   some gzip-compressed), ``--malformed`` share of malformed ones (bad JSON, schema violations, bad
   encodings, oversize bodies) and ``--disconnects`` share whose client hangs up early, spread over every
   route that takes the System One body (``/v1/systemone``, OpenRouter's, Workers AI's). Checks: every valid
   request 200 (no 5xx), every malformed one a 4xx, no timeouts; resident memory (VmRSS) after the soak
   within 10% of after the warm-up; the engine idle at the end (``/metrics``: running 0, waiting 0, KV
   blocks used 0, GDN slots used 0).
2. overload: a second server with ``--max-queue 2 --max-num-seqs 1``, flooded with long records: every
   request answered at once with 200 or 429 + ``Retry-After`` (JSON ``error_type: overloaded``), none
   times out, and the pools are empty afterwards.

Everything is bounded: request counts, a client timeout per request, a deadline per phase. Exits 1 and
prints what went wrong when a check fails. ``tests/test_soak.py`` runs the same phases at a reduced size.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from clefserve.testing.server_process import ServerProcess
from clefserve.testing.tokenizer import WORDS

ROUTE = "/v1/systemone"
# Every route that takes the System One body; calls are spread over them (the adapters share one handler,
# so the same checks hold: valid bodies 200, malformed ones 4xx).
ROUTES = (ROUTE, "/api/alpha/decisions", "/client/v4/accounts/0123abcd/ai/run/@cf%2Fcloudflare%2Fclef-flash",
          "/ai/run/@cf/cloudflare/clef")
MIB = 1 << 20
RSS_GROWTH_LIMIT = 0.10
UNICODE = ("é", "ß", "Ω", "中文", "🙂", "naïve", "עברית")
LABELS = ("billing", "sales", "technical", "account", "refund", "other", "Ω", "中文", "10", "9")
# Server flags of both phases: a small KV pool and prefix cache budget, so that the warm-up touches the
# pool's pages and fills the (bounded) prefix cache; after that, resident memory must stay flat.
BASE_FLAGS = ("--kv-cache-mb", "16", "--prefix-cache-mb", "8")


# ---- workload ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    kind: str  # "good", "bad" (malformed: must be a 4xx) or "disconnect" (client hangs up early)
    name: str
    content: bytes
    headers: dict[str, str] = field(default_factory=dict)
    abort_after_s: float | None = None
    path: str = ROUTE


@dataclass
class Outcome:
    call: Call
    status: int | None  # None: no response (aborted on purpose, or an error)
    latency_s: float
    error: str | None = None  # "aborted" for an intended disconnect; else a timeout or transport error
    retry_after: str | None = None
    body: str = ""


def _text(rng: random.Random, low: int, high: int) -> str:
    words = [rng.choice(UNICODE) if rng.random() < 0.08 else rng.choice(WORDS)
             for _ in range(rng.randint(low, high))]
    return " ".join(words)


def good_body(rng: random.Random, long: bool = False) -> dict[str, Any]:
    """A valid System One body: 1-4 questions of the three types, a short or long state."""
    questions: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(("noul", "choice", "score"))
        question: dict[str, Any] = {"type": kind}
        if rng.random() < 0.85:
            question["instructions"] = _text(rng, 2, 12) if rng.random() < 0.8 else {"task": _text(rng, 1, 4)}
        if kind == "choice":
            labels = rng.sample(LABELS, rng.randint(2, 5))
            question["criteria"] = {label: (_text(rng, 1, 6) if rng.random() < 0.7 else None)
                                    for label in labels}
        elif kind == "score":
            question["criteria"] = [_text(rng, 1, 4) for _ in range(rng.randint(2, 6))]
        elif rng.random() < 0.4:
            question["criteria"] = {"true": _text(rng, 1, 4), "false": _text(rng, 1, 4)}
        questions[f"{rng.choice(WORDS)}_{i}"] = question
    if long:
        state: Any = {"ticket": rng.randint(1, 99_999), "message": _text(rng, 300, 900)}
    else:
        roll = rng.random()
        if roll < 0.4:
            state = _text(rng, 3, 60)
        elif roll < 0.8:
            tags = [_text(rng, 1, 2) for _ in range(rng.randint(0, 3))]
            state = {"channel": rng.choice(("email", "chat")), "amount": rng.choice((1250.0, 12, -0.5)),
                     "message": _text(rng, 3, 40), "tags": tags}
        else:
            state = rng.choice((None, 0, 12.5, True, "", [], {}, [1, "two", {"three": 3.0}]))
    return {"model": rng.choice(("clef-flash", "jev-latest")), "state": state, "questions": questions}


def _json(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()


def malformed_calls() -> list[tuple[str, bytes, dict[str, str]]]:
    """(name, body, extra headers): each must be refused with a 4xx."""
    good = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}
    q = lambda question: _json({**good, "questions": {"q": question}})  # noqa: E731
    return [
        ("not-json", b"model=clef&state=x", {}),
        ("truncated", _json(good)[:-7], {}),
        ("empty", b"", {}),
        ("array", b"[1, 2, 3]", {}),
        ("missing-questions", _json({"model": "m", "state": "s"}), {}),
        ("model-number", _json({**good, "model": 7}), {}),
        ("no-type", q({"instructions": "x"}), {}),
        ("unknown-type", q({"type": "box"}), {}),
        ("extra-field", q({"type": "noul", "instruction": "typo"}), {}),
        ("choice-1-label", q({"type": "choice", "criteria": {"only": None}}), {}),
        ("score-11-levels", q({"type": "score", "criteria": [str(i) for i in range(11)]}), {}),
        ("score-object", q({"type": "score", "criteria": {"0": "low", "1": "high"}}), {}),
        ("questions-65", _json({**good, "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}), {}),
        ("nan", b'{"model": "m", "state": NaN, "questions": {"q": {"type": "noul"}}}', {}),
        ("duplicate-key", b'{"model": "m", "state": 1, "questions": {"q": {"type": "noul"}, "q": 2}}', {}),
        ("invalid-utf8", b'{"model": "m", "state": "\xff\xfe", "questions": {"q": {"type": "noul"}}}', {}),
        ("nested-200", b'{"model": "m", "questions": {"q": {"type": "noul"}}, "state": ' + b"[" * 200
         + b"]" * 200 + b"}", {}),
        ("huge-integer", b'{"model": "m", "state": ' + b"9" * 5000
         + b', "questions": {"q": {"type": "noul"}}}', {}),
        ("images", _json({**good, "images": ["aGVsbG8="]}), {}),
        ("too-large", _json({**good, "state": "x" * (MIB + 1024)}), {}),
        ("bad-gzip", b"\x1f\x8b not gzip at all", {"content-encoding": "gzip"}),
        ("unknown-encoding", _json(good), {"content-encoding": "br"}),
        ("multipart", b"--x\r\n\r\n", {"content-type": "multipart/form-data; boundary=x"}),
        # TypeSafe's image assets, wrong in each way that names a part or an asset
        ("asset-unreferenced", _json({**good, "assets": {"<image:" + "a" * 32 + ">": {
            "type": "image", "format": "png", "data_base64": "aGVsbG8="}}}), {}),
        ("asset-dangling", _json({**good, "state": "see <image:" + "b" * 32 + ">"}), {}),
        ("multipart-unclaimed", _multipart(good, ("asset-0", b"\x89PNG\r\n\x1a\n")), _FORM),
        ("multipart-missing-part", _multipart({**good, "state": "<image:" + "c" * 32 + ">", "assets": {
            "<image:" + "c" * 32 + ">": {"type": "image", "part": "asset-1"}}}, ("asset-0", b"GIF89a")),
         _FORM),
        ("multipart-truncated", _multipart(good, ("asset-0", b"\xff\xd8\xff"))[:-20], _FORM),
    ]


_FORM = {"content-type": "multipart/form-data; boundary=soak-boundary"}


def _multipart(request: Any, *parts: tuple[str, bytes]) -> bytes:
    """A multipart/form-data body as TypeSafe's SDK sends one: the JSON request, then image parts."""
    chunks = [b'--soak-boundary\r\nContent-Disposition: form-data; name="request"\r\n'
              b"Content-Type: application/json\r\n\r\n" + _json(request) + b"\r\n"]
    for name, data in parts:
        chunks.append(f'--soak-boundary\r\nContent-Disposition: form-data; name="{name}"\r\n'
                      "Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(chunks) + b"--soak-boundary--\r\n"


def build_calls(count: int, malformed: float, disconnects: float, seed: int) -> list[Call]:
    """``count`` calls, exactly ``round(count * share)`` malformed and disconnecting ones, shuffled."""
    rng = random.Random(seed)
    n_bad, n_gone = round(count * malformed), round(count * disconnects)
    kinds = ["bad"] * n_bad + ["disconnect"] * n_gone + ["good"] * (count - n_bad - n_gone)
    rng.shuffle(kinds)
    catalogue = malformed_calls()
    bad = iter(range(rng.randrange(len(catalogue)), 10**9))  # every kind once per len(catalogue) bad calls
    calls = []
    for kind in kinds:
        if kind == "bad":
            name, content, headers = catalogue[next(bad) % len(catalogue)]
            # a bad "model" is no fault on Workers AI's routes, which take the model from the path
            routes = ROUTES[:2] if name == "model-number" else ROUTES
            calls.append(Call("bad", name, content, {"content-type": "application/json", **headers},
                              path=rng.choice(routes)))
        elif kind == "disconnect":
            # a long record, so that the client leaves while the engine holds it or queues it
            body = _json(good_body(rng, long=True))
            calls.append(Call("disconnect", "disconnect", body, {"content-type": "application/json"},
                              abort_after_s=rng.uniform(0.005, 0.2), path=rng.choice(ROUTES)))
        else:
            long = rng.random() < 0.1
            content = _json(good_body(rng, long=long))
            headers = {"content-type": "application/json"}
            if rng.random() < 0.1:
                content, headers["content-encoding"] = gzip.compress(content), "gzip"
            calls.append(Call("good", "long" if long else "short", content, headers, path=rng.choice(ROUTES)))
    return calls


# ---- client -----------------------------------------------------------------------------------------

async def _send(client: httpx.AsyncClient, call: Call) -> Outcome:
    started = time.perf_counter()
    request = client.post(call.path, content=call.content, headers=call.headers)
    try:
        if call.abort_after_s is not None:
            response = await asyncio.wait_for(request, call.abort_after_s)
        else:
            response = await request
    except TimeoutError:  # asyncio.wait_for: the intended early hang-up
        return Outcome(call, None, time.perf_counter() - started, "aborted")
    except httpx.TimeoutException as exc:
        return Outcome(call, None, time.perf_counter() - started, f"timeout: {type(exc).__name__}")
    except httpx.TransportError as exc:
        return Outcome(call, None, time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - started
    body = "" if response.status_code == 200 else response.text[:300]
    return Outcome(call, response.status_code, latency, None, response.headers.get("retry-after"), body)


async def _run_all(url: str, calls: list[Call], concurrency: int, timeout_s: float) -> list[Outcome]:
    outcomes: list[Outcome | None] = [None] * len(calls)
    next_index = iter(range(len(calls)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def worker() -> None:
            for i in next_index:
                outcomes[i] = await _send(client, calls[i])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [o for o in outcomes if o is not None]


def run_calls(url: str, calls: list[Call], concurrency: int, timeout_s: float = 120,
              deadline_s: float = 600) -> list[Outcome]:
    """Send ``calls`` with ``concurrency`` connections; each call bounded by ``timeout_s``, all by
    ``deadline_s`` (a TimeoutError then)."""

    async def bounded() -> list[Outcome]:
        return await asyncio.wait_for(_run_all(url, calls, concurrency, timeout_s), deadline_s)

    return asyncio.run(bounded())


# ---- server-side readings ---------------------------------------------------------------------------

def rss_bytes(pid: int) -> int:
    """VmRSS of a process, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def scrape(url: str) -> dict[str, float]:
    """Every sample of ``/metrics``: ``name`` or ``name{label="value",...}`` -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


ENGINE_IDLE = ("clef_engine_running_sequences", "clef_engine_waiting_sequences", "clef_engine_kv_blocks_used",
               "clef_engine_gdn_slots_used")


def wait_idle(url: str, timeout_s: float = 20) -> dict[str, float]:
    """Scrape until the engine holds nothing (cancelled sequences are reaped within a poll or two)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if all(samples.get(name) == 0 for name in ENGINE_IDLE) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


# ---- checks -----------------------------------------------------------------------------------------

def problems_of(outcomes: list[Outcome]) -> list[str]:
    problems = []
    for o in outcomes:
        c = o.call
        if c.kind == "good" and o.status != 200:
            problems.append(f"good {c.name} request: {o.status} {o.error or ''} {o.body}")
        elif c.kind == "bad" and (o.status is None or not 400 <= o.status < 500):
            problems.append(f"malformed {c.name} request: {o.status} {o.error or ''} {o.body}")
        elif c.kind == "disconnect" and not (o.error == "aborted" or o.status == 200):
            problems.append(f"disconnecting request: {o.status} {o.error or ''} {o.body}")
    return problems


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class SoakResult:
    requests: int
    concurrency: int
    wall_s: float
    statuses: dict[str, int]
    rss_warm: int
    rss_end: int
    engine_end: dict[str, float]
    latencies: dict[str, float]
    server: dict[str, float]
    problems: list[str]

    @property
    def rss_growth(self) -> float:
        return self.rss_end / self.rss_warm - 1

    def summary(self) -> str:
        lat = self.latencies
        idle = ", ".join(f"{n.removeprefix('clef_engine_')} {self.engine_end.get(n)}" for n in ENGINE_IDLE)
        return "\n".join([
            f"soak: {self.requests} requests at concurrency {self.concurrency} in {self.wall_s:.1f}s "
            f"({self.requests / self.wall_s:.1f} req/s)",
            f"  outcomes: {dict(sorted(self.statuses.items()))}",
            f"  good requests: p50 {lat['p50'] * 1000:.0f} ms, p95 {lat['p95'] * 1000:.0f} ms, "
            f"p99 {lat['p99'] * 1000:.0f} ms, max {lat['max'] * 1000:.0f} ms",
            f"  server: mean queue wait {self.server['queue_wait_mean'] * 1000:.1f} ms, mean compute "
            f"{self.server['compute_mean'] * 1000:.1f} ms over {self.server['decisions']:.0f} decisions; "
            f"{self.server['prefill_tokens']:.0f} prefill tokens, {self.server['cancelled']:.0f} cancelled",
            f"  prefix cache: {self.server['prefix_cache_bytes'] / MIB:.1f} of "
            f"{self.server['prefix_cache_budget_bytes'] / MIB:.0f} MiB, "
            f"{self.server['kv_blocks_cached']:.0f} KV blocks, {self.server['prefix_cache_hits']:.0f} hits",
            f"  VmRSS: {self.rss_warm / MIB:.1f} MiB after warm-up, {self.rss_end / MIB:.1f} MiB after "
            f"({100 * self.rss_growth:+.1f}%, limit +{100 * RSS_GROWTH_LIMIT:.0f}%)",
            f"  engine at the end: {idle}",
            f"  problems: {len(self.problems)}",
            *(f"    {p}" for p in self.problems[:20]),
        ])


def _label(o: Outcome) -> str:
    if o.status is not None:
        return f"{o.call.kind} {o.status}"
    return f"{o.call.kind} {'aborted' if o.error == 'aborted' else 'error'}"


def soak(folder: Path, workdir: Path, requests: int, concurrency: int, malformed: float = 0.05,
         disconnects: float = 0.05, warmup: int | None = None, threads: int = 1, seed: int = 0,
         deadline_s: float = 900, flags: tuple[str, ...] = ()) -> SoakResult:
    # Resident memory settles over the first several hundred requests (allocator caches, the prefix cache
    # filling its budget, the KV pool's pages being touched), hence a quarter of the run as warm-up.
    warmup = warmup if warmup is not None else max(2 * concurrency, requests // 4)
    with ServerProcess(folder, workdir / "soak-server.log", *BASE_FLAGS, *flags, threads=threads) as server:
        pid = server.process.pid
        problems = [f"warm-up: {p}" for p in problems_of(run_calls(
            server.url, build_calls(warmup, malformed, disconnects, seed + 1), concurrency,
            deadline_s=deadline_s))]
        wait_idle(server.url)
        rss_warm = rss_bytes(pid)
        started = time.perf_counter()
        outcomes = run_calls(server.url, build_calls(requests, malformed, disconnects, seed), concurrency,
                             deadline_s=deadline_s)
        wall = time.perf_counter() - started
        samples = wait_idle(server.url)
        rss_end = rss_bytes(pid)
    problems += problems_of(outcomes)
    engine_end = {name: samples.get(name, float("nan")) for name in ENGINE_IDLE}
    problems += [f"engine not idle at the end: {name} = {value}" for name, value in engine_end.items()
                 if value != 0]
    if rss_end > rss_warm * (1 + RSS_GROWTH_LIMIT):
        problems.append(f"VmRSS grew from {rss_warm / MIB:.1f} MiB to {rss_end / MIB:.1f} MiB")
    good = [o.latency_s for o in outcomes if o.call.kind == "good" and o.status == 200]
    latencies = {"p50": _percentile(good, 0.5), "p95": _percentile(good, 0.95),
                 "p99": _percentile(good, 0.99), "max": max(good, default=float("nan"))}
    decisions = samples.get("clef_request_compute_seconds_count", 0)
    server_side = {
        "decisions": decisions,
        "queue_wait_mean": samples.get("clef_request_queue_wait_seconds_sum", 0) / max(decisions, 1),
        "compute_mean": samples.get("clef_request_compute_seconds_sum", 0) / max(decisions, 1),
        "prefill_tokens": samples.get("clef_engine_prefill_tokens_total", 0),
        "cancelled": samples.get('clef_engine_sequences_total{outcome="cancelled"}', 0),
        "kv_blocks_cached": samples.get("clef_engine_kv_blocks_cached", 0),
        "prefix_cache_bytes": samples.get("clef_engine_prefix_cache_bytes", 0),
        "prefix_cache_budget_bytes": samples.get("clef_engine_prefix_cache_budget_bytes", 0),
        "prefix_cache_hits": samples.get("clef_engine_prefix_cache_hits_total", 0),
    }
    if server_side["prefix_cache_bytes"] > server_side["prefix_cache_budget_bytes"] > 0:
        problems.append(f"prefix cache over its budget: {server_side['prefix_cache_bytes']:.0f} bytes")
    return SoakResult(requests, concurrency, wall, dict(Counter(_label(o) for o in outcomes)), rss_warm,
                      rss_end, engine_end, latencies, server_side, problems)


@dataclass
class OverloadResult:
    requests: int
    statuses: dict[str, int]
    slowest_429_s: float
    engine_end: dict[str, float]
    problems: list[str]

    def summary(self) -> str:
        return "\n".join([
            f"overload (--max-queue 2 --max-num-seqs 1): {self.requests} long records at once",
            f"  outcomes: {dict(sorted(self.statuses.items()))}; "
            f"slowest 429 {self.slowest_429_s * 1000:.0f} ms",
            f"  problems: {len(self.problems)}",
            *(f"    {p}" for p in self.problems[:20]),
        ])


def overload(folder: Path, workdir: Path, requests: int = 24, threads: int = 1, seed: int = 0,
             timeout_s: float = 60) -> OverloadResult:
    """Flood a server whose queue holds 2: every request is answered (200 or 429 + Retry-After)."""
    rng = random.Random(seed)
    calls = [Call("good", "long", _json(good_body(rng, long=True)), {"content-type": "application/json"})
             for _ in range(requests)]
    flags = (*BASE_FLAGS, "--max-queue", "2", "--max-num-seqs", "1")
    with ServerProcess(folder, workdir / "overload-server.log", *flags, threads=threads) as server:
        outcomes = run_calls(server.url, calls, concurrency=requests, timeout_s=timeout_s,
                             deadline_s=4 * timeout_s)
        samples = wait_idle(server.url)
    problems = []
    for o in outcomes:
        if o.status == 429:
            detail = json.loads(o.body).get("detail", {}) if o.body.startswith("{") else {}
            if not (o.retry_after and o.retry_after.isdigit() and int(o.retry_after) >= 1):
                problems.append(f"429 without a usable Retry-After: {o.retry_after!r}")
            if detail.get("error_type") != "overloaded":
                problems.append(f"429 body: {o.body}")
        elif o.status != 200:
            problems.append(f"flood request: {o.status} {o.error or ''} {o.body}")
    rejected = [o.latency_s for o in outcomes if o.status == 429]
    if not rejected:
        problems.append("no request was refused with 429: the queue never filled")
    engine_end = {name: samples.get(name, float("nan")) for name in ENGINE_IDLE}
    problems += [f"engine not idle at the end: {name} = {value}" for name, value in engine_end.items()
                 if value != 0]
    return OverloadResult(requests, dict(Counter(_label(o) for o in outcomes)), max(rejected, default=0.0),
                          engine_end, problems)


# ---- command line -----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--malformed", type=float, default=0.05, help="share of malformed bodies")
    parser.add_argument("--disconnects", type=float, default=0.05, help="share of early client hang-ups")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up requests (default: 25%%)")
    parser.add_argument("--overload-requests", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--release", type=Path, default=None,
                        help="release folder to serve (default: a random tiny one)")
    parser.add_argument("--server-args", default="", help="extra clef-serve flags")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="clef-soak-") as tmp:
        workdir = Path(tmp)
        folder = args.release
        if folder is None:
            from clefserve.testing.release import build_release

            folder = build_release(workdir / "release", None, seed=args.seed)
        flags = tuple(args.server_args.split())
        result = soak(folder, workdir, args.requests, args.concurrency, args.malformed, args.disconnects,
                      args.warmup, args.threads, args.seed, flags=flags)
        print(result.summary(), flush=True)
        flood = overload(folder, workdir, args.overload_requests, args.threads, args.seed)
        print(flood.summary(), flush=True)
        print(f"verdict: {'PASS' if not (result.problems or flood.problems) else 'FAIL'}")
    return 1 if result.problems or flood.problems else 0


if __name__ == "__main__":
    sys.exit(main())

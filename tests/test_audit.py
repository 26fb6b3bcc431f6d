"""The live audit: answered requests re-run through the reference path in idle time catch a fault that the
startup canaries miss, and find nothing on a sound server.

The late fault (``CLEF_FAULT_ZERO_CONV_BAND=k@N``, clefserve.model.ops.faults) zeroes the key band of the
conv output only for tokens at positions >= N; N is set just past the longest canary record, so the startup
self-check passes and only longer live records are answered wrong.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from clefserve.config import EngineConfig
from clefserve.engine import Engine
from clefserve.errors import RequestError
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.audit import AuditJob, Auditor
from clefserve.formats.clef.canary import build_canaries
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.model.ops import reference_ops
from clefserve.model.ops.faults import (
    FAULT_ENV,
    ConvBandFault,
    late_zeroed_band_ops,
    ops_from_environment,
    parse_fault,
    zeroed_band_ops,
)
from clefserve.model.weights import load_backbone
from clefserve.server.logging import JsonFormatter
from clefserve.server.metrics import Metrics
from clefserve.testing.server_process import ServerProcess
from tests.engine_support import audits_concluded, small_config
from tests.request_gen import RequestGenerator

SEED = 31  # the release test_self_check uses (built once per session)
SECRET = "SECRET-STATE-MARKER"


async def connected() -> bool:
    return False


def longest_canary(decider: ClefDecider, chunk_tokens: int = 1024) -> int:
    """The longest startup canary for an engine with ``--prefill-chunk-size chunk_tokens``."""
    canaries, _ = build_canaries(decider.encode, chunk_tokens, decider.encoder.max_length)
    return max(canary.tokens for canary in canaries)


def long_request(decider: ClefDecider, tokens: int, tag: int) -> dict[str, Any]:
    """A request whose record is at least ``tokens`` long; ``tag`` makes its state unique."""
    words = ["ticket", "charge", "refund", "portal", "order", "late", "card", "login"]
    rng = random.Random(tag)
    text = [SECRET, str(tag)]
    body: dict[str, Any] = {"model": "m", "state": {}, "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {"type": "choice", "criteria": {"billing": None, "technical": "Bugs", "sales": None}}}}
    while True:
        body["state"] = {"message": " ".join(text)}
        if len(decider.encode(body).input_ids) >= tokens:
            return body
        text.extend(rng.choices(words, k=200))


# ---- the fault hook ----

@pytest.mark.parametrize(("value", "fault"), [
    ("", None), ("  ", None), ("k", ConvBandFault("k", 0)), ("V", ConvBandFault("v", 0)),
    ("k@2048", ConvBandFault("k", 2048)), (" q@0 ", ConvBandFault("q", 0)),
])
def test_fault_spec(value: str, fault: ConvBandFault | None) -> None:
    assert parse_fault(value) == fault


@pytest.mark.parametrize("value", ["key", "k@", "k@x", "k@-1", "k@1.5", "x@5", "k@@2", "@2048", "k 2048"])
def test_fault_spec_typos_are_errors(value: str, monkeypatch: pytest.MonkeyPatch, make_release) -> None:
    with pytest.raises(ValueError, match=FAULT_ENV):
        parse_fault(value)
    config = load_backbone(make_release(seed=SEED)).config
    monkeypatch.setenv(FAULT_ENV, value)
    with pytest.raises(ValueError, match=FAULT_ENV):
        ops_from_environment(config)
    monkeypatch.setenv(FAULT_ENV, "k@2048")
    assert ops_from_environment(config).name.endswith("zeroed-k-band@2048")


@torch.inference_mode()
def test_late_fault_zeroes_only_the_positions_past_it(make_release) -> None:
    model = load_backbone(make_release(seed=SEED))
    ids = torch.randint(0, model.config.vocab_size, (400,), generator=torch.Generator().manual_seed(3))
    sound, _ = model.run_sequence(ids)
    # zeroing the band where the delta rule reads it is the same fault as zeroing the conv output
    model.set_ops(zeroed_band_ops(model.config, "k"))
    everywhere, _ = model.run_sequence(ids)
    model.set_ops(late_zeroed_band_ops("k", 0, reference_ops()))
    assert torch.equal(model.run_sequence(ids)[0], everywhere)
    model.set_ops(zeroed_band_ops(model.config, "k", from_position=250))
    late, _ = model.run_sequence(ids)
    assert torch.equal(late[:250], sound[:250])
    assert (late[250:] - sound[250:]).abs().amax(-1).min().item() > 1e-3  # every late row is off
    # the fault follows positions, not how the sequence is cut into pieces
    pieces, state = [], None
    for start, end in ((0, 100), (100, 260), (260, 400)):
        hidden, state = model.run_sequence(ids[start:end], state)
        pieces.append(hidden)
    assert (torch.cat(pieces) - late).abs().max().item() <= 1e-5


def test_the_demo_canaries_miss_a_fault_from_token_2048_and_the_audit_catches_it(monkeypatch) -> None:
    """The README's walk-through: CLEF_FAULT_ZERO_CONV_BAND=k@2048 on the demo model."""
    from clefserve.cli import serving_decider
    from clefserve.demo import DEMO_FOLDER

    monkeypatch.setenv(FAULT_ENV, "k@2048")
    config = EngineConfig(audit_fraction=1.0, kv_cache_mb=64)
    decider = serving_decider(DEMO_FOLDER, config, "cpu")
    assert longest_canary(decider) < 2048
    backend = EngineBackend(decider, config, "clef-demo")
    message = "Hi, I was charged twice for order A-104. I want a refund, today please. " * 120
    body = {"model": "clef-demo", "state": {"channel": "email", "message": message},
            "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}
    try:
        assert backend.run_self_check() == []
        answer = asyncio.run(backend.decide(body, "demo", connected))
        stats = asyncio.run(audits_concluded(backend, 1))
    finally:
        backend.engine.shutdown()
    assert answer["usage"]["input_tokens"] > 2048
    assert stats["mismatch"] == 1, stats


def test_audit_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from clefserve import cli

    args = cli.build_parser().parse_args(["serve", "--audit-fraction", "0.25", "--audit-fail-ready", "3",
                                          "--audit-max-queue", "8", "--audit-queue-mb", "2"])
    config = EngineConfig.from_args(args)
    assert (config.audit_fraction, config.audit_fail_ready, config.audit_max_queue,
            config.audit_queue_mb) == (0.25, 3, 8, 2)
    assert EngineConfig().audit_fraction == 0.01 and EngineConfig().audit_fail_ready == 0
    for bad in (["--audit-fraction", "1.5"], ["--audit-fraction", "nan"], ["--audit-fail-ready", "-1"],
                ["--audit-max-queue", "0"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", *bad])
        assert "expected" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert "--audit-fraction" in capsys.readouterr().out


# ---- the engine's idle hook ----

class Pieces:
    """Idle work with ``remaining`` pieces; records what was in flight when each piece started."""

    def __init__(self, engine: Engine, remaining: int) -> None:
        self.engine, self.remaining = engine, remaining
        self.seen: list[tuple[int, int]] = []  # (sequences waiting or running, submissions so far)
        self.submitted = 0

    def pending(self) -> bool:
        return self.remaining > 0

    def run_piece(self) -> None:
        scheduler = self.engine.scheduler
        self.seen.append((len(scheduler.waiting) + len(scheduler.running), self.submitted))
        self.remaining -= 1


def test_idle_work_waits_while_sequences_wait_or_run(make_release) -> None:
    model = load_backbone(make_release(seed=SEED))
    gen = torch.Generator().manual_seed(0)
    with Engine(model, small_config(prefill_chunk_size=16), lambda fs: [None] * len(fs)) as engine:
        futures = [engine.submit(torch.randint(0, 500, (90,), generator=gen)) for _ in range(6)]
        work = Pieces(engine, remaining=5)
        engine.set_idle_work(work)  # the six sequences are all queued: it must wait for every step
        for future in futures:
            future.result(timeout=60)
        for _ in range(1000):
            if not work.pending():
                break
            time.sleep(0.01)
        steps = engine.stats()["steps"]
    assert steps >= 6 * 90 // 16 and work.seen == [(0, 0)] * 5


def test_a_new_sequence_waits_for_at_most_one_piece(make_release) -> None:
    model = load_backbone(make_release(seed=SEED))
    with Engine(model, small_config(), lambda fs: [None] * len(fs)) as engine:
        work = Pieces(engine, remaining=10**9)  # never runs out: the engine is never idle
        engine.set_idle_work(work)
        for round_ in range(1, 21):
            work.submitted = round_
            engine.submit(torch.arange(1, 40)).result(timeout=60)
            # a piece that starts while the sequence is in flight: only one that the worker had already
            # chosen to run when the sequence arrived
            overlapping = [n for n, submitted in work.seen if submitted == round_ and n > 0]
            assert len(overlapping) <= 1, work.seen[-5:]
            time.sleep(0.002)  # let some pieces run in between
        engine.set_idle_work(None)
    assert len(work.seen) > 20


# ---- the audit in-process ----

def _backend(decider: ClefDecider, **overrides: Any) -> EngineBackend:
    values = dict(max_num_seqs=4, prefill_chunk_size=512, kv_cache_mb=32, audit_fraction=1.0,
                  max_length=decider.encoder.max_length)
    values.update(overrides)
    return EngineBackend(decider, EngineConfig(**values), "clef-audit")


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("clefserve")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(level)


def metric_samples(metrics: Metrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_audit_catches_a_late_fault_the_self_check_misses(make_release, json_log: io.StringIO) -> None:
    decider = ClefDecider(make_release(seed=SEED))
    late = longest_canary(decider, chunk_tokens=512)  # _backend's --prefill-chunk-size
    decider.backbone.set_ops(zeroed_band_ops(decider.backbone.config, "k", from_position=late))
    backend = _backend(decider, audit_fail_ready=3)
    metrics = Metrics(backend.stats)
    assert backend.run_self_check() == [] and backend.ready() == (True, "ready")  # the canaries miss it

    async def run() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        short = [await backend.decide(long_request(decider, 0, 100), "short-0", connected)]
        answers = [await backend.decide(long_request(decider, late + 200, i), f"long-{i}", connected)
                   for i in range(3)]
        return short + answers, await audits_concluded(backend, 4)

    answers, stats = asyncio.run(run())
    try:
        assert all(a["answers"]["team"]["type"] == "choice" for a in answers)  # well-formed, wrong
        assert (stats["match"], stats["mismatch"], stats["skipped"]) == (1, 3, 0), stats
        assert stats["failed"] and stats["last_mismatch"]["request_id"] == "long-2"
        ok, reason = backend.ready()
        assert not ok and "live audit: 3 requests" in reason and "long-2" in reason
        with pytest.raises(RequestError) as refused:
            asyncio.run(backend.decide(long_request(decider, 0, 7), "after", connected))
        assert refused.value.status == 503 and "live audit" in str(refused.value)
        s = metric_samples(metrics)
        assert s['clef_audit_total{result="mismatch"}'] == 3 and s['clef_audit_total{result="match"}'] == 1
        assert s['clef_audit_total{result="skipped"}'] == 0
        assert s["clef_audit_max_probability_difference_count"] == 4
        assert s['clef_audit_max_probability_difference_bucket{le="0.0001"}'] == 1  # the short one
    finally:
        backend.engine.shutdown()
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    mismatches = [line for line in lines if line["msg"].startswith("live audit MISMATCH")]
    assert [line["request_id"] for line in mismatches] == ["long-0", "long-1", "long-2"]
    for line in mismatches:
        options = line["audit_options"]
        assert {o["question"] for o in options} <= {"refund", "team"} and options
        for o in options:
            assert o["option"] in {"true", "false", "billing", "technical", "sales"}
            assert abs(o["serving"] - o["reference"]) > line["audit_tolerance"]
    assert SECRET not in json_log.getvalue()  # never the state


def test_five_hundred_audited_requests_on_a_sound_server_all_match(make_release) -> None:
    decider = ClefDecider(make_release(seed=SEED), max_length=320)
    generator, bodies = RequestGenerator(seed=16), []
    states = []
    while len(states) < 100:  # short records; each state asked five question sets (prefix cache hits)
        body = generator.request(long_state=False, max_questions=1)
        try:
            decider.encode(body)
        except RequestError:
            continue
        states.append(body["state"])
    while len(bodies) < 500:
        body = {**generator.request(long_state=False, max_questions=2), "state": states[len(bodies) % 100]}
        try:
            decider.encode(body)
        except RequestError:  # the schema does not fit
            continue
        bodies.append(body)
    backend = _backend(decider, max_num_seqs=8, prefill_chunk_size=512, audit_max_queue=500,
                       audit_fail_ready=1)

    async def run() -> dict[str, Any]:
        limit = asyncio.Semaphore(8)

        async def one(i: int, body: dict[str, Any]) -> None:
            async with limit:
                await backend.decide(body, f"r{i}", connected)

        await asyncio.gather(*(one(i, body) for i, body in enumerate(bodies)))
        return await audits_concluded(backend, len(bodies), timeout_s=300)

    try:
        stats = asyncio.run(run())
        engine = backend.engine.stats()
    finally:
        backend.engine.shutdown()
    assert (stats["match"], stats["mismatch"], stats["skipped"]) == (500, 0, 0), stats
    assert not stats["failed"] and stats["max_difference"]["count"] == 500
    assert engine["prefix_hits"] > 0 and engine["multi_seq_steps"] > 0  # cached and batched answers too


def test_audit_off_samples_nothing_and_still_exports_zeros(make_release) -> None:
    decider = ClefDecider(make_release(seed=SEED))
    backend = _backend(decider, audit_fraction=0.0)
    try:
        asyncio.run(backend.decide(long_request(decider, 0, 1), "r", connected))
        s = metric_samples(Metrics(backend.stats))
        assert backend.audit is None and backend.stats()["audit"]["enabled"] is False
        assert s['clef_audit_total{result="match"}'] == 0 and s["clef_audit_queued"] == 0
    finally:
        backend.engine.shutdown()


def test_audit_queue_is_bounded_in_count_and_memory(make_release) -> None:
    decider = ClefDecider(make_release(seed=SEED))
    record = decider.encode(long_request(decider, 600, 0))
    probs = [[0.5, 0.5], [0.2, 0.3, 0.5]]
    size = AuditJob.of("r", record, probs).nbytes  # the ids as int32, 4 bytes a token, and a little more
    assert 4 * len(record.input_ids) < size < 4 * len(record.input_ids) + 4096
    auditor = Auditor(decider, 1.0, piece_tokens=128, max_queue=4, max_queue_bytes=3 * size + 10)
    for i in range(10):
        auditor.offer(f"r{i}", record, probs)
    stats = auditor.stats()
    assert stats["queued"] == 3 and stats["queued_bytes"] == 3 * size  # the byte bound bites first
    assert stats["skipped"] == 7 and stats["skipped_because"] == {"queue_full": 7}
    assert [job.request_id for job in auditor._queue] == ["r7", "r8", "r9"]  # the newest are kept
    huge = decider.encode(long_request(decider, 3000, 1))
    auditor.offer("huge", huge, probs)
    assert auditor.stats()["skipped_because"]["too_large"] == 1
    counted = Auditor(decider, 1.0, piece_tokens=128, max_queue=2, max_queue_bytes=1 << 20)
    for i in range(5):
        counted.offer(f"r{i}", record, probs)
    assert counted.stats()["queued"] == 2 and counted.stats()["skipped"] == 3
    # the pieces of one audit, then it concludes (probabilities here are made up: a mismatch)
    pieces = 0
    while counted.pending():
        counted.run_piece()
        pieces += 1
    assert pieces == 2 * -(-len(record.input_ids) // 128)
    assert counted.stats()["mismatch"] == 2 and counted.stats()["queued_bytes"] == 0


# ---- a real server ----

def _samples(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_a_server_with_a_late_fault_turns_ready_then_the_audit_takes_it_out(make_release,
                                                                            tmp_path: Path) -> None:
    folder = make_release(seed=SEED)
    decider = ClefDecider(folder)
    late = longest_canary(decider)
    log = tmp_path / "server.log"
    with ServerProcess(folder, log, "--audit-fraction", "1", "--audit-fail-ready", "3",
                       env={FAULT_ENV: f"k@{late}"}) as server:  # ready: the self-check missed it
        assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 200
        statuses = []
        for i in range(6):  # a stream of long requests, one at a time
            body = long_request(decider, late + 300, i)
            statuses.append(httpx.post(f"{server.url}/v1/systemone", json=body, timeout=60).status_code)
        ready = httpx.get(f"{server.url}/ready", timeout=5)
        for _ in range(200):
            if ready.status_code == 503:
                break
            time.sleep(0.1)
            ready = httpx.get(f"{server.url}/ready", timeout=5)
        s = _samples(server.url)
        after = httpx.post(f"{server.url}/v1/systemone", json=long_request(decider, 0, 9), timeout=60)
    assert statuses[:3] == [200, 200, 200]
    assert ready.status_code == 503 and "live audit" in ready.json()["reason"], ready.text
    assert s['clef_audit_total{result="mismatch"}'] >= 3 and s['clef_audit_total{result="match"}'] == 0
    assert after.status_code == 503
    text = log.read_text()
    assert "startup self-check passed" in text and "live audit MISMATCH" in text
    assert SECRET not in text

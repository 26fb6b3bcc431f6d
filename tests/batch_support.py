"""Batch test workloads and comparisons: a seeded JSONL file of System One bodies with duplicated states,
malformed lines and oversize records, a way to run ``clef-serve batch``, and answer comparisons."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clefserve.testing.release import ReleaseSpec
from clefserve.testing.server_process import ROOT
from clefserve.testing.tokenizer import WORDS

# Two layers (one Gated DeltaNet, one attention): the reference delta rule dominates the cost of a record.
BATCH_SPEC = ReleaseSpec(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
# Engine flags shared by the batch runs and the HTTP server they are compared with.
MAX_BODY_BYTES = 6000
MAX_LENGTH = 1024
ENGINE_FLAGS = ("--dtype", "f32", "--max-num-seqs", "16", "--prefill-chunk-size", "1024",
                "--kv-cache-mb", "48", "--max-length", str(MAX_LENGTH),
                "--max-body-bytes", str(MAX_BODY_BYTES), "--x-raw-probabilities", "--log-level", "warning")
RAW_TOLERANCE = 1e-5
MALFORMED = (
    b"{not json",
    b'{"model": "m", "state": 1, "questions": {}}',
    b'{"model": "m", "state": NaN, "questions": {"a": {"type": "noul"}}}',
    b'{"model": "m", "state": 1, "state": 2, "questions": {"a": {"type": "noul"}}}',
    b"[1, 2]",
    b'{"model": "m", "state": "x", "questions": {"a": {"type": "maybe"}}}',
)
ROUNDED_TOLERANCE = 1e-4 + 1e-9  # a rounded value may flip at a rounding boundary


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(low, high)))


def question(rng: random.Random, kind: str) -> dict[str, Any]:
    """Short questions (the records stay short, so 2,000 of them run in seconds on a tiny release)."""
    if kind == "noul":
        return {"type": "noul", "instructions": words(rng, 1, 3), "criteria": {"true": None, "false": None}}
    if kind == "choice":
        labels = rng.sample(WORDS, rng.randint(2, 3))
        return {"type": "choice", "instructions": words(rng, 1, 3),
                "criteria": {label: rng.choice([None, None, words(rng, 1, 2)]) for label in labels}}
    return {"type": "score", "instructions": {"ask": words(rng, 1, 2)},
            "criteria": [rng.choice(WORDS) for _ in range(rng.randint(2, 3))]}


def questions(rng: random.Random) -> dict[str, Any]:
    kinds = ["noul", "choice", "score"]
    return {f"q{j}": question(rng, rng.choice(kinds)) for j in range(rng.choice([1, 1, 2]))}


@dataclass
class Workload:
    """``lines``: the file's lines (bytes, without newline). ``ids``: line number -> the id ``batch`` gives
    that line's record. ``duplicates``: line numbers whose id repeats an earlier line's (skipped)."""

    lines: list[bytes] = field(default_factory=list)
    ids: dict[int, str | int] = field(default_factory=dict)
    duplicates: list[int] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)

    def add(self, line: bytes, record_id: str | int | None, kind: str) -> None:
        self.lines.append(line)
        number = len(self.lines)
        self.ids[number] = number if record_id is None else record_id
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def write(self, path: Path) -> Path:
        path.write_bytes(b"".join(line + b"\n" for line in self.lines))
        return path


def make_workload(records: int, seed: int) -> Workload:
    """Mostly short valid records; states repeat (the same state asked other or the same questions);
    about 3% malformed lines, 1% lines over ``MAX_BODY_BYTES``, 1% schemas over ``MAX_LENGTH`` tokens, 2%
    states cut to fit; ids are strings, integers, or missing (the line number then)."""
    rng = random.Random(seed)
    work = Workload()
    states: list[Any] = []
    while len(work.lines) < records:
        n = len(work.lines)
        roll = rng.random()
        record_id: str | int | None = rng.choice([f"r{n}", f"r{n}", 100_000 + n, None])
        body_id = {} if record_id is None else {"id": record_id}
        if roll < 0.03:
            line = rng.choice(MALFORMED)
            work.add(line, None, "malformed")
            continue
        if roll < 0.04:
            body = {**body_id, "model": "clef", "state": words(rng, 1500, 1600), "questions": questions(rng)}
            kind = "over_body_limit"
            record_id = None  # a line that is not read has its line number as id
        elif roll < 0.05:
            labels = {f"{w}{i}": words(rng, 10, 12) for i, w in enumerate(rng.sample(WORDS, 40))}
            body = {**body_id, "model": "clef", "state": words(rng, 3, 8),
                    "questions": {"big": {"type": "choice", "instructions": "pick", "criteria": labels}}}
            kind = "schema_too_long"
        elif roll < 0.07:
            body = {**body_id, "model": "clef", "state": words(rng, 550, 650), "questions": questions(rng)}
            kind = "state_cut"
        else:
            if states and rng.random() < 0.45:
                state = rng.choice(states[-40:])
                kind = "repeated_state"
            else:
                state = {"ticket": rng.randint(1, 99_999), "message": words(rng, 2, 12)}
                states.append(state)
                kind = "fresh_state"
            body = {**body_id, "model": rng.choice(["clef", "jev-latest"]), "state": state,
                    "questions": questions(rng)}
        line = json.dumps(body, ensure_ascii=False).encode()
        if kind == "over_body_limit":
            assert len(line) > MAX_BODY_BYTES
        work.add(line, record_id, kind)
    # two repeated ids: batch answers the first line with an id and skips the later ones
    for _ in range(2):
        first = next(i for i, v in work.ids.items() if isinstance(v, str) and i > len(work.lines) // 2)
        body = {"id": work.ids[first], "model": "clef", "state": "again",
                "questions": {"a": {"type": "noul"}}}
        work.lines.append(json.dumps(body).encode())
        work.duplicates.append(len(work.lines))
    return work


def run_batch(input_path: Path, output: Path, release: Path, *extra: str, threads: int = 1,
              timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(batch_command(input_path, output, release, *extra), cwd=ROOT,
                          env=batch_env(threads), capture_output=True, text=True, timeout=timeout)


def batch_command(input_path: Path, output: Path, release: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "clefserve.cli", "batch", "--w", str(release), str(input_path),
            "-o", str(output), *ENGINE_FLAGS, *extra]


def batch_env(threads: int = 1) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TYPESAFE_", "CLEF_"))}
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def summary_of(stderr: str) -> dict[str, Any]:
    """The fields of the JSON summary line that ``--quiet --log-level info`` logs."""
    for line in stderr.splitlines():
        if line.startswith("{") and '"batch finished"' in line:
            return json.loads(line)["summary"]
    raise AssertionError(f"no summary line in:\n{stderr[-3000:]}")


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def by_id(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for line in lines:
        key = str(line["id"])
        assert key not in out, f"id {key!r} written twice"
        out[key] = line
    return out


def assert_same_line(ours: dict[str, Any], theirs: dict[str, Any], where: str) -> None:
    """Two OUTPUT lines of the same record: the same error, or the same answer (``assert_same_answer``)."""
    assert ours["id"] == theirs["id"], where
    if "error" in ours or "error" in theirs:
        assert ours == theirs, where
    else:
        assert_same_answer(ours, theirs, where)


def assert_same_answer(ours: dict[str, Any], theirs: dict[str, Any], where: str) -> float:
    """Two response bodies of the same request: equal except floats (unrounded ``x_probabilities`` within
    ``RAW_TOLERANCE``, rounded values within one rounding step) and ``usage.x_cached_tokens`` (what the
    prefix cache held depends on what ran before). Returns the largest raw probability difference."""
    assert ours["model"] == theirs["model"], where
    usage = {k: v for k, v in ours["usage"].items() if k != "x_cached_tokens"}
    assert usage == {k: v for k, v in theirs["usage"].items() if k != "x_cached_tokens"}, where
    assert list(ours["answers"]) == list(theirs["answers"]), where
    worst = 0.0
    for qid, answer in ours["answers"].items():
        other = theirs["answers"][qid]
        assert list(answer) == list(other), (where, qid)
        for key, value in answer.items():
            if key == "x_probabilities":
                assert list(value) == list(other[key]), (where, qid)
                for option, p in value.items():
                    worst = max(worst, abs(p - other[key][option]))
            elif key in ("probabilities", "legend") or not isinstance(value, float):
                if key == "probabilities":
                    for option, p in value.items():
                        assert abs(p - other[key][option]) <= ROUNDED_TOLERANCE, (where, qid, option)
                elif key == "choice" and value != other[key]:  # only a near-tie may pick another label
                    raw = answer["x_probabilities"]
                    assert abs(raw[value] - raw[other[key]]) <= 2 * RAW_TOLERANCE, (where, qid)
                else:
                    assert value == other[key], (where, qid, key)
            else:
                tolerance = ROUNDED_TOLERANCE * (len(answer.get("legend", {})) or 1)
                assert abs(value - other[key]) <= tolerance, (where, qid, key, value, other[key])
    assert worst <= RAW_TOLERANCE, (where, worst)
    return worst

"""A seeded JSONL file of System One bodies for ``clef-serve batch``: short records on a tiny random release,
states that repeat, malformed lines, lines over the body limit, schemas over the token limit and states cut
to fit. The batch tests compare ``batch`` with the HTTP server on it, and ``benchmarks.batch`` times both."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clefserve.testing.release import ReleaseSpec
from clefserve.testing.tokenizer import WORDS

# Two layers (one Gated DeltaNet, one attention): the reference delta rule dominates the cost of a record.
BATCH_SPEC = ReleaseSpec(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
# Engine flags shared by the batch runs and the HTTP server they are compared with.
MAX_BODY_BYTES = 6000
MAX_LENGTH = 1024
ENGINE_FLAGS = ("--dtype", "f32", "--max-num-seqs", "16", "--prefill-chunk-size", "1024",
                "--kv-cache-mb", "48", "--max-length", str(MAX_LENGTH),
                "--max-body-bytes", str(MAX_BODY_BYTES), "--x-raw-probabilities", "--log-level", "warning")
MALFORMED = (
    b"{not json",
    b'{"model": "m", "state": 1, "questions": {}}',
    b'{"model": "m", "state": NaN, "questions": {"a": {"type": "noul"}}}',
    b'{"model": "m", "state": 1, "state": 2, "questions": {"a": {"type": "noul"}}}',
    b"[1, 2]",
    b'{"model": "m", "state": "x", "questions": {"a": {"type": "maybe"}}}',
)


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

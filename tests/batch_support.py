"""Running ``clef-serve batch`` in the tests and comparing its answers (the workload itself is
``clefserve.testing.batch_workload``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from clefserve.testing.batch_workload import ENGINE_FLAGS
from clefserve.testing.server_process import ROOT

RAW_TOLERANCE = 1e-5
ROUNDED_TOLERANCE = 1e-4 + 1e-9  # a rounded value may flip at a rounding boundary


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

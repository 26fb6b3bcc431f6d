"""scripts/gpu_check.sh, the one-run GPU check, exercised on the CPU: its --dry-run goes through every
stage (verify, the conv-band fault that must fail verify, benchmarks/gpu.py --dry-run, the CUDA test files
collected) and reports each in summary.txt; a budget too small for any stage skips them all and fails the
run. What it measures on a GPU is not tested here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["facts", "verify", "fault", "bench", "tests", "kernels", "profile"]


def run_check(out: Path, *args: str, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": python}
    script = ROOT / "scripts" / "gpu_check.sh"
    return subprocess.run(["bash", str(script), "--dry-run", "--out", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=600)


def summary(out: Path) -> dict[str, str]:
    lines = (out / "summary.txt").read_text().splitlines()[1:]
    return {line.split()[0]: line.split(maxsplit=1)[1] for line in lines}


@pytest.mark.slow
def test_every_stage_of_the_dry_run_passes_and_leaves_its_log(tmp_path):
    done = run_check(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = summary(tmp_path)
    assert list(verdicts) == STAGES
    assert all(v.startswith("passed in") for v in verdicts.values()), verdicts
    assert "passed (" in (tmp_path / "verify.log").read_text()
    assert "FAILED (" in (tmp_path / "fault.log").read_text()  # the fault was caught: exit 1, as expected
    assert "max |Δp|" in (tmp_path / "bench.log").read_text()
    assert "test_engine_equality.py" in (tmp_path / "tests.log").read_text()
    assert "delta rule" in (tmp_path / "profile.log").read_text()


def test_a_budget_too_small_for_any_stage_fails_the_run(tmp_path):
    done = run_check(tmp_path, "--budget", "10")
    assert done.returncode == 1
    verdicts = summary(tmp_path)
    assert list(verdicts) == STAGES
    assert all(v.startswith("skipped") for v in verdicts.values()), verdicts


def test_an_unknown_argument_is_refused(tmp_path):
    done = run_check(tmp_path, "--budgte", "10")
    assert done.returncode == 2 and "unknown argument --budgte" in done.stderr


def test_a_crash_does_not_pass_for_the_fault_being_caught(tmp_path):
    """The fault stage wants exit 1 with verify's own FAILED verdict: an interpreter that cannot even start
    (exit 127) fails it like every other stage."""
    done = run_check(tmp_path, python=str(tmp_path / "no-such-python"))
    assert done.returncode == 1
    verdicts = summary(tmp_path)
    assert all(v.startswith("FAILED") for v in verdicts.values()), verdicts
    assert verdicts["fault"].startswith("FAILED: exit 3, expected 1")

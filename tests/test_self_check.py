"""The startup self-check and ``clef-serve verify`` catch a conv that zeroes the key band.

The fault is injected on purpose through ``CLEF_FAULT_ZERO_CONV_BAND`` (clefserve.model.ops.faults), in a
real process: the serving path then runs the faulty conv while the reference path runs the torch ops.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from clefserve.testing.server_process import ROOT, ServerProcess


def verify(folder, fault: str | None) -> subprocess.CompletedProcess:
    """``clef-serve verify`` on ``folder`` (None: no ``--w``, the embedded demo model)."""
    env = {k: v for k, v in os.environ.items() if k != "CLEF_FAULT_ZERO_CONV_BAND"}
    env["OMP_NUM_THREADS"] = "1"
    if fault:
        env["CLEF_FAULT_ZERO_CONV_BAND"] = fault
    weights = [] if folder is None else ["--w", str(folder)]
    return subprocess.run(
        [sys.executable, "-m", "clefserve.cli", "verify", *weights, "--log-level", "warning"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(params=["random", "demo"])
def release(request, make_release):
    return make_release(seed=31) if request.param == "random" else None


def test_verify_passes_on_a_sound_release(release):
    result = verify(release, fault=None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout


def test_verify_fails_when_the_key_band_is_zeroed(release):
    result = verify(release, fault="k")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "MISMATCH canary" in result.stdout and "FAILED" in result.stdout


def test_verify_fails_when_the_value_band_is_zeroed(make_release):
    result = verify(make_release(seed=31), fault="v")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "MISMATCH canary" in result.stdout


def test_a_server_with_the_broken_conv_never_turns_ready(make_release, tmp_path):
    log = tmp_path / "server.log"
    server = ServerProcess(make_release(seed=31), log, env={"CLEF_FAULT_ZERO_CONV_BAND": "k"})
    try:
        reason = server.wait_refusal("self-check failed")  # never 200 on the way
        assert "self-check failed" in reason, log.read_text()[-3000:]
        assert "canary" in reason
        time.sleep(1)
        assert httpx.get(f"{server.url}/ready", timeout=2).status_code == 503
        assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200
        body = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}
        assert httpx.post(f"{server.url}/v1/systemone", json=body, timeout=10).status_code == 503
        model = httpx.get(f"{server.url}/v1/status", timeout=10).json()["model"]
        assert (model["ready"], model["phase"], model["self_check"]["result"]) == (
            False, "self_check_failed", "failed")
        assert model["self_check"]["problem"].startswith("canary 1 of 3")
        assert model["self_check"]["finished_at"]
        text = log.read_text()
        assert "startup self-check FAILED" in text and "canary 1 of 3 (long)" in text
    finally:
        server.stop()


def test_a_sound_server_passes_the_self_check(make_release, tmp_path):
    log = tmp_path / "server.log"
    with ServerProcess(make_release(seed=31), log) as server:
        assert httpx.get(f"{server.url}/ready", timeout=2).status_code == 200
        model = httpx.get(f"{server.url}/v1/status", timeout=10).json()["model"]
        assert (model["ready"], model["phase"], model["self_check"]["result"]) == (True, "ready", "passed")
        assert model["self_check"]["finished_at"] and model["self_check"]["problem"] is None
    text = log.read_text()
    assert "startup self-check passed" in text
    # progress: each canary through each path, with its tokens and the seconds it took
    for i, name in enumerate(("long", "shared-a", "shared-b"), 1):
        canary = rf"self-check canary {i} of 3 \({name}\)"
        assert re.search(canary + r", serving path: \d+ tokens .* after [\d.]+ s", text)
        assert re.search(canary + r", reference path: \d+ tokens in [\d.]+ s", text)
    assert "split inside its state by the chunk budget" in text and "shared state resumed" in text

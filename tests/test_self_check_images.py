"""With a vision tower, the startup self-check and ``clef-serve verify`` run canaries with pictures, and a
broken vision path (a prefix cache blind to picture content, stale encoder-cache rows) keeps /ready at 503.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import torch

from clefserve.config import EngineConfig
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.canary import build_canaries, image_canary_requests
from clefserve.formats.clef.engine_backend import IMAGE_KEYS_FAULT_ENV, EngineBackend
from clefserve.testing.release import ReleaseSpec, VisionSpec
from clefserve.testing.server_process import ROOT, ServerProcess

SPEC = ReleaseSpec(head_dim=32, partial_rotary_factor=0.5, vision=VisionSpec())


def _backend(decider: ClefDecider) -> EngineBackend:
    config = EngineConfig(max_num_seqs=4, prefill_chunk_size=96, block_size=16, kv_cache_mb=16)
    return EngineBackend(decider, config, "clef-vision")


@pytest.fixture
def decider(make_release) -> ClefDecider:
    return ClefDecider(make_release(SPEC, seed=13))


def test_canaries_with_pictures_pass_on_a_sound_release(decider, monkeypatch):
    monkeypatch.delenv(IMAGE_KEYS_FAULT_ENV, raising=False)
    canaries, _ = build_canaries(decider.encode, 96, 16384, images=True)
    assert [c.name for c in canaries if "images" in c.request] == ["image-a", "image-b", "image-c"]
    backend = _backend(decider)
    try:
        assert backend.run_self_check() == []
        assert backend.ready() == (True, "ready")
        stats = backend.stats()
        assert stats is not None and stats["images_encoded"] >= 3 and stats["encoder_cache_hits"] >= 1
    finally:
        assert backend.engine is not None
        backend.engine.shutdown()


def test_a_prefix_cache_blind_to_pictures_is_caught(decider, monkeypatch):
    monkeypatch.setenv(IMAGE_KEYS_FAULT_ENV, "1")
    backend = _backend(decider)
    try:
        problems = backend.run_self_check()
        # the other picture's record
        assert problems and all("canary 5 of 6 (image-b)" in p for p in problems), problems
        ok, reason = backend.ready()
        assert not ok and "self-check failed" in reason
    finally:
        assert backend.engine is not None
        backend.engine.shutdown()


def test_stale_encoder_cache_rows_are_caught(decider, monkeypatch):
    """The reference path encodes pictures afresh, so wrong rows served from the cache are a mismatch."""
    monkeypatch.delenv(IMAGE_KEYS_FAULT_ENV, raising=False)
    assert decider.images is not None and decider.images.encoder.cache is not None
    first_picture = decider.encode(image_canary_requests()[0][1]).prepared_images[0]
    rows = decider.images.embed([first_picture], use_cache=False)[0]
    decider.images.encoder.cache.put(first_picture.digest, torch.roll(rows, 1, dims=0))
    backend = _backend(decider)
    try:
        assert backend.run_self_check()
        assert not backend.ready()[0]
    finally:
        assert backend.engine is not None
        backend.engine.shutdown()


def verify(folder, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != IMAGE_KEYS_FAULT_ENV}
    env.update(OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "clefserve.cli", "verify", "--w", str(folder), "--log-level", "warning"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


def test_verify_with_pictures(make_release):
    """``clef-serve verify`` also compares the canaries with pictures against transformers' Qwen3.5
    (vision tower included) and fails on the blind prefix cache."""
    folder = make_release(SPEC, seed=13)
    result = verify(folder, {})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout
    result = verify(folder, {IMAGE_KEYS_FAULT_ENV: "1"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "MISMATCH canary 5 of 6 (image-b)" in result.stdout


def test_a_server_with_the_blind_prefix_cache_never_turns_ready(make_release, tmp_path):
    log = tmp_path / "server.log"
    server = ServerProcess(make_release(SPEC, seed=13), log, env={IMAGE_KEYS_FAULT_ENV: "1"})
    try:
        reason = server.wait_refusal("self-check failed", timeout_s=180)  # never 200 on the way
        assert "self-check failed" in reason and "(image-b)" in reason, log.read_text()[-3000:]
        assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200
    finally:
        server.stop()

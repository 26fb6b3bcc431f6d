"""Freed host memory is kept for reuse: a step's activations do not page-fault in again every step."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from clefserve.engine.host_malloc import keep_freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def _faults_of_repeated_allocations(rounds: int = 20, floats: int = 2 << 20) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        torch.ones(floats).sum()  # 8 MiB written, then freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_reused_activation_size_faults_in_once() -> None:
    if not keep_freed_memory():
        pytest.skip("this C library has no mallopt")
    _faults_of_repeated_allocations(rounds=1)
    pages_per_round = (8 << 20) // resource.getpagesize()
    # each round would fault in all of its 2,048 pages if freed blocks went back to the kernel
    assert _faults_of_repeated_allocations() < pages_per_round

"""The engine's intra-op thread choice (clefserve.engine.threads)."""

from __future__ import annotations

import pytest
import torch

from clefserve.engine.threads import PARALLEL_WORK, EngineThreads

CPU = torch.device("cpu")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_small_steps_run_on_one_thread(two_threads):
    threads = EngineThreads(hidden_size=96, step_tokens=1024, device=CPU)  # the demo model
    assert threads.count == 1 and "1 intra-op thread of 2" in threads.describe()
    threads.apply()
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize(("hidden", "tokens"), [(256, 1024), (2048, 64), (256, PARALLEL_WORK // 256**2)])
def test_large_steps_keep_every_thread(two_threads, hidden, tokens):
    threads = EngineThreads(hidden_size=hidden, step_tokens=tokens, device=CPU)
    threads.apply()
    assert threads.count == 2 and torch.get_num_threads() == 2


def test_a_gpu_engine_leaves_the_setting_alone(two_threads):
    threads = EngineThreads(hidden_size=64, step_tokens=16, device=torch.device("cuda", 0))
    threads.apply()
    assert torch.get_num_threads() == 2

"""Shared fixtures: random releases are built once per test session and reused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from clefserve.testing.release import ReleaseSpec, build_release
from tests import device as test_device

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="torch device of the device-aware tests (cpu, cuda, cuda:1); default cpu")
    parser.addoption("--dtype", default="f32", choices=["f32", "f16", "bf16"],
                     help="dtype of the device-aware tests; f16/bf16 use the dtype tolerances (default f32)")


def pytest_configure(config):
    test_device.configure(config.getoption("--device"), config.getoption("--dtype"))


def pytest_report_header(config):
    return f"clef-serve tests on device {test_device.device()}, dtype {test_device.dtype()}"


@pytest.fixture(scope="session")
def make_release(tmp_path_factory) -> Callable[..., Path]:
    """``make_release(spec=None, seed=0, **build_kwargs)`` -> folder, cached per argument set."""
    cache: dict[str, Path] = {}

    def make(spec: ReleaseSpec | None = None, seed: int = 0, **kwargs) -> Path:
        key = repr((spec, seed, sorted(kwargs.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"release{len(cache)}")
            cache[key] = build_release(folder, spec, seed=seed, **kwargs)
        return cache[key]

    return make

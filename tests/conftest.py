"""Shared fixtures: random releases are built once per test session and reused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from clefserve.testing.release import ReleaseSpec, build_release

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


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

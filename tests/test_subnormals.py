"""Subnormal floats are flushed to zero on the engine's thread and its OpenMP team, and nowhere else
(clefserve.engine.subnormals)."""

from __future__ import annotations

import platform
import textwrap

import pytest
import torch

from clefserve.engine import Engine
from clefserve.model.weights import load_backbone
from tests.engine_support import ENGINE_SPECS, keep_hidden, small_config
from tests.fresh_process import run_reporting_json

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="FTZ/DAZ are x86 control bits")

SUBNORMAL = 1e-39  # below the smallest normal float32, 1.18e-38

# A fresh interpreter: which threads flush must not depend on what pytest's process did before.
SCRIPT = textwrap.dedent(f"""
    import json, threading
    import torch
    from clefserve.engine.subnormals import flush_subnormals_here

    torch.set_num_threads(2)
    tiny = torch.full((1 << 20,), {SUBNORMAL})  # large enough for a parallel region on two threads
    report = {{}}

    def worker():
        (tiny * 1.0).sum()  # this thread's OpenMP team exists before it flushes
        report["flushing"] = flush_subnormals_here()
        report["serial"] = (torch.tensor([{SUBNORMAL}]) * 1.0).item()
        report["parallel_nonzero"] = int((tiny * 1.0).count_nonzero())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    report["main_serial"] = (torch.tensor([{SUBNORMAL}]) * 1.0).item()
    report["main_parallel_nonzero"] = int((tiny * 1.0).count_nonzero())
    print(json.dumps(report))
""")


def test_the_flushing_thread_and_its_team_flush_and_other_threads_do_not() -> None:
    report = run_reporting_json(SCRIPT)
    assert report["flushing"] is True
    assert report["serial"] == 0.0
    assert report["parallel_nonzero"] == 0  # the team built again after flushing flushes too
    assert report["main_serial"] > 0.0  # the process's other threads keep subnormals
    assert report["main_parallel_nonzero"] == 1 << 20


def test_the_engine_thread_flushes_subnormals(make_release) -> None:
    model = load_backbone(make_release(ENGINE_SPECS["default"], seed=5))
    with Engine(model, small_config(), keep_hidden) as engine:
        on_engine = engine.on_engine_thread(lambda: (torch.tensor([SUBNORMAL]) * 1.0).item())
    assert on_engine == 0.0
    assert (torch.tensor([SUBNORMAL]) * 1.0).item() > 0.0

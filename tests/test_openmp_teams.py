"""A thread that did torch work off the engine's thread lets its OpenMP team go (clefserve.engine.openmp).

Run in a fresh interpreter: pytest's own process has run torch on other threads already.
"""

from __future__ import annotations

import textwrap

import pytest

from clefserve.engine.openmp import _libgomp
from tests.fresh_process import run_reporting_json

pytestmark = pytest.mark.skipif(_libgomp() is None, reason="torch here does not run on GNU OpenMP")

SCRIPT = textwrap.dedent("""
    import json, os, threading
    import torch
    from clefserve.engine.openmp import release_thread_team

    torch.set_num_threads(2)
    x = torch.randn(4096, 512)
    expected = (x * 2).sum(0)

    def threads():
        return len(os.listdir("/proc/self/task"))

    report = {}
    released = threading.Event()
    go_on = threading.Event()
    done = threading.Event()

    def loader():  # as the server's loading thread: parallel torch work, then it stays alive
        (x * 2).sum(0)
        report["with_team"] = threads()
        report["released"] = release_thread_team()
        report["after_release"] = threads()
        released.set()
        go_on.wait()
        report["again_equal"] = bool(torch.equal((x * 2).sum(0), expected))  # a new team works
        done.set()

    worker = threading.Thread(target=loader)
    before = threads()
    worker.start()
    released.wait()
    go_on.set()
    done.wait()
    worker.join()
    report["before"] = before + 1  # the loader itself
    print(json.dumps(report))
""")


def test_release_lets_the_idle_team_of_a_living_thread_exit() -> None:
    report = run_reporting_json(SCRIPT)
    assert report["released"] is True
    assert report["with_team"] > report["before"]  # the parallel region started a worker thread
    assert report["after_release"] == report["before"]  # and it is gone while the thread lives on
    assert report["again_equal"] is True


ENGINE_SCRIPT = textwrap.dedent("""
    import json, os, tempfile, threading, time
    import torch
    from clefserve.config import EngineConfig
    from clefserve.engine import Engine
    from clefserve.engine.openmp import release_thread_team
    from clefserve.model.weights import load_backbone
    from clefserve.testing.release import ReleaseSpec, build_release

    torch.set_num_threads(2)
    folder = build_release(tempfile.mkdtemp(), ReleaseSpec(head=None), seed=0)
    model = load_backbone(folder)
    release_thread_team()

    def threads():
        return len(os.listdir("/proc/self/task"))

    def settled():  # a released team's threads exit shortly after the call returns
        counts = [threads()]
        for _ in range(50):
            time.sleep(0.02)
            counts.append(threads())
            if len(counts) >= 3 and counts[-1] == counts[-2] == counts[-3]:
                break
        return counts[-1]

    report = {}

    def embedder():  # a program that builds an engine on its own thread and then only feeds it
        torch.set_num_threads(2)
        config = EngineConfig(max_num_seqs=2, prefill_chunk_size=64, block_size=8, kv_cache_mb=64)
        with Engine(model, config, lambda finished: [None] * len(finished)) as engine:
            engine.submit(torch.arange(200) % 100).result(timeout=60)  # the engine's own team exists now
            report["serving"] = settled()
            report["released"] = release_thread_team()  # what the engine should have let go already
            report["after_release"] = settled()

    worker = threading.Thread(target=embedder)
    worker.start()
    worker.join()
    print(json.dumps(report))
""")


def test_building_an_engine_leaves_no_team_on_the_building_thread() -> None:
    """Building the engine zeroes and faults in its pools on the calling thread, in parallel regions: that
    thread's team, idle beside the engine's, put the engine's OpenMP threads in libgomp's throttled wait
    (measured: 15-18% of the CPU idle and ~30,000 context switches a second while serving, steps ~10%
    slower). The engine releases it: releasing it again afterwards finds no thread to let go."""
    report = run_reporting_json(ENGINE_SCRIPT)
    assert report["released"] is True
    assert report["after_release"] == report["serving"]

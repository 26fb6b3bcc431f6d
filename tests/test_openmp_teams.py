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

"""Serving processes freeze what they loaded out of the garbage collector's passes
(:mod:`clefserve.engine.python_heap`): a full collection of a loaded server holds the GIL for 60-85 ms on the
benchmark host, and the engine's lanes stop for that long. Each freeze runs in a process of its own (a freeze
is for the life of a process). The collector's passes are recorded per generation and exported."""

from __future__ import annotations

import gc
import json
import re
import threading

import httpx

from clefserve.demo import DEMO_FOLDER
from clefserve.engine.python_heap import collector_pauses
from clefserve.server.metrics import Metrics
from clefserve.testing.server_process import ServerProcess
from tests.batch_support import run_batch
from tests.fresh_process import run_reporting_json

FREEZE_SCRIPT = """
import gc, json, weakref
import clefserve.formats.clef.engine_backend  # what a server imports: torch, FastAPI, pydantic
from clefserve.engine.python_heap import freeze_loaded_objects
loaded = len(gc.get_objects())
frozen = freeze_loaded_objects()
left = len(gc.get_objects())  # what a full collection still walks (the frozen generation is not listed)
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a  # garbage that only a cyclic collection frees
cycle = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({"loaded": loaded, "frozen": frozen, "count": gc.get_freeze_count(), "left": left,
                  "cycle_collected": cycle() is None}))
"""


def test_freezing_takes_the_loaded_objects_out_of_the_collections():
    result = run_reporting_json(FREEZE_SCRIPT)
    assert result["frozen"] == result["count"]
    assert result["frozen"] >= 0.9 * result["loaded"] > 50_000, result
    assert result["left"] < 100, result
    assert result["cycle_collected"], "collections must still run for what comes after the freeze"


def _freeze_after_check(log_text: str) -> None:
    checked = log_text.find("startup self-check passed")
    frozen = log_text.find("loaded objects frozen")
    assert 0 <= checked < frozen, log_text[-3000:]


def test_the_server_freezes_its_heap_once_loaded_and_checked(tmp_path):
    log = tmp_path / "server.log"
    with ServerProcess(None, log, "--log-level", "info") as server:
        models = httpx.get(f"{server.url}/v1/models", timeout=10)
        assert models.status_code == 200
    _freeze_after_check(log.read_text())


def test_batch_freezes_its_heap_once_loaded_and_checked(tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"model": "clef-demo", "state": {"message": "I was charged twice."},
                                   "questions": {"refund": {"type": "noul",
                                                            "instructions": "Asks for a refund?"}}}) + "\n")
    done = run_batch(records, tmp_path / "answers.jsonl", DEMO_FOLDER, "--quiet", "--log-level", "info")
    assert done.returncode == 0, done.stderr[-3000:]
    _freeze_after_check(done.stderr)


def test_the_pause_recorder_counts_each_generations_passes_from_any_thread():
    collector_pauses.install()
    collector_pauses.install()
    assert gc.callbacks.count(collector_pauses._callback) == 1
    gc.disable()  # only the passes asked for below
    try:
        before = collector_pauses.totals()
        gc.collect(0)
        worker = threading.Thread(target=gc.collect, args=(2,))
        worker.start()
        worker.join()
        after = collector_pauses.totals()
    finally:
        gc.enable()
    assert [n1 - n0 for (n0, _), (n1, _) in zip(before, after, strict=True)] == [1, 0, 1]
    assert after[2][1] > before[2][1]


def test_metrics_export_the_pauses_and_the_frozen_objects():
    text = Metrics().render().decode()
    gc.collect(2)
    again = Metrics().render().decode()

    def full_passes(exposition: str) -> float:
        return float(re.search(r'^clef_python_gc_pause_seconds_count\{generation="2"\} (\S+)$', exposition,
                               re.M).group(1))

    assert full_passes(again) >= full_passes(text) + 1
    frozen = re.search(r"^clef_python_gc_frozen_objects (\S+)$", again, re.M)
    assert frozen is not None and float(frozen.group(1)) == gc.get_freeze_count()

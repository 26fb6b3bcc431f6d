"""benchmarks/heap.py: the in-process side of a comparison gets the heap thresholds the server runs with,
unless ``--heap glibc`` is asked for."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import heap


@pytest.fixture
def applied(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(1) or True)
    return calls


def test_the_default_is_the_servers_heap(applied):
    parser = argparse.ArgumentParser()
    heap.add_heap_argument(parser)
    choice = parser.parse_args([]).heap
    assert choice == "kept"
    assert heap.prepare_heap(choice) == "heap kept as the server's"
    assert applied == [1]


def test_glibc_leaves_the_defaults(applied):
    parser = argparse.ArgumentParser()
    heap.add_heap_argument(parser)
    assert heap.prepare_heap(parser.parse_args(["--heap", "glibc"]).heap) == "glibc heap defaults"
    assert applied == []


def test_an_unknown_heap_is_refused(applied):
    with pytest.raises(ValueError):
        heap.prepare_heap("tcmalloc")
    assert applied == []

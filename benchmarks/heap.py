"""The heap thresholds of a benchmark process that runs a side of a comparison in process.

Our server keeps freed memory in its heap (:mod:`clefserve.engine.host_malloc`), so a request does not fault
its working set in again. A reference measured in the benchmark's own process under glibc's defaults does.
Cloudflare's ``systemone()`` took 1,000-128,000 minor faults per ~3,000-token record on ``clef256`` (2
threads); how many depends on what ran before in the process. In bf16 that made it ~40% slower (medians over
three processes each: 353 ms against 253 ms with the server's thresholds); in fp32 the medians were equal. So
by default the benchmarks give the in-process side the thresholds the server runs with (``--heap kept``).
The comparison is then between the engines, not between allocator settings. ``--heap glibc`` keeps glibc's
defaults (the reference as an untuned process runs it). The setting is process-wide: it holds for everything
measured in the process.
"""

from __future__ import annotations

import argparse

from clefserve.engine.host_malloc import keep_freed_memory

HEAPS = ("kept", "glibc")


def add_heap_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heap", choices=HEAPS, default="kept",
                        help="heap thresholds of this process, where the reference runs: kept (as our server "
                             "sets them, the default) or glibc (its defaults; see benchmarks/heap.py)")


def prepare_heap(heap: str) -> str:
    """Apply ``heap`` (one of :data:`HEAPS`) to this process; a few words for the benchmark's header."""
    if heap not in HEAPS:
        raise ValueError(f"heap {heap!r}: one of {', '.join(HEAPS)}")
    if heap == "kept":
        return "heap kept as the server's" if keep_freed_memory() else "glibc heap (no mallopt here)"
    return "glibc heap defaults"

"""Freed host memory is kept for reuse: a step's activations do not page-fault in again every step, and a heap
grown before serving takes what a filling prefix cache retains without faulting it in."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from clefserve.engine import host_malloc
from clefserve.engine.host_malloc import keep_freed_memory, prefault_heap

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


# Each measurement runs in a fresh process: what earlier tests left in the heap (a block held right after
# a freed one) decides where the next allocation lands, so in a shared process a count can include a growth
# that has nothing to do with the thresholds. A thread's heap is its arena, and arenas outlive their threads.
_REPEATED_ALLOCATIONS = """
import ctypes, resource, sys, torch
from clefserve.engine.host_malloc import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
else:  # the control: blocks of 1 MiB and more are mapped for each allocation and unmapped when freed
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD, fixed (no dynamic adjustment)
torch.ones(2 << 20).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(2 << 20).sum()  # 8 MiB written, then freed
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(script: str, arg: str = "") -> list[int]:
    out = subprocess.run([sys.executable, "-c", script, arg], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    return [int(word) for word in out.split()]


def test_a_reused_activation_size_faults_in_once() -> None:
    if not keep_freed_memory():
        pytest.skip("this C library has no mallopt")
    pages_per_round = (8 << 20) // resource.getpagesize()
    # Kept: the 20 rounds reuse the warm-up's pages, or at most one more block's: where a small allocation
    # landed in the freed block, the next one grows the heap once (seen on a CI host: exactly 2,048 pages),
    # plus a few incidental pages. (glibc's defaults fault in about two blocks here; see the control below.)
    assert _run(_REPEATED_ALLOCATIONS, "keep")[0] <= pages_per_round + 256
    # Handed back to the kernel at every free, each round faults in all of its pages again.
    assert _run(_REPEATED_ALLOCATIONS, "return")[0] >= 15 * pages_per_round


# A thread that keeps allocating retained tensors between activations, as a prefix cache filling up does, with
# its heap grown beforehand or not. Prints the page faults of that phase and the pages it retains.
_RETAINING_THREAD = """
import resource, sys, threading, torch
from clefserve.engine.host_malloc import keep_freed_memory, prefault_heap
keep_freed_memory()
torch.set_num_threads(1)
def work():
    prefault_heap(int(sys.argv[1]))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = []
    for _ in range(40):
        activations = [torch.ones(3 << 18) for _ in range(6)]
        held += [torch.ones(1 << 20), torch.ones(1000)]
        del activations
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(faults, sum(t.numel() * 4 for t in held) // resource.getpagesize())
threading.Thread(target=work).start()
"""


def test_a_prefaulted_heap_takes_retained_tensors_without_faulting_them_in():
    if not keep_freed_memory():
        pytest.skip("this C library has no mallopt")
    cold, retained_pages = _run(_RETAINING_THREAD, "0")
    warm, _ = _run(_RETAINING_THREAD, str(512 << 20))
    assert cold >= retained_pages  # every retained page is new to the heap: the check below can fail
    assert warm < retained_pages // 20


def test_prefault_heap_is_bounded_and_a_no_op_for_nothing(monkeypatch):
    assert prefault_heap(0) == 0
    if keep_freed_memory():
        assert prefault_heap(20 << 20) == 16 << 20  # whole chunks
        # the bound, lowered so that this process does not keep a GiB of heap for the rest of the suite
        monkeypatch.setattr(host_malloc, "PREFAULT_MAX_BYTES", 24 << 20)
        assert prefault_heap(host_malloc.PREFAULT_MAX_BYTES * 4) == host_malloc.PREFAULT_MAX_BYTES

"""Keep freed host memory for reuse instead of handing it back to the kernel after every step.

glibc serves allocations above its mmap threshold (128 KiB, growing only as far as blocks are freed) with
fresh ``mmap`` pages and unmaps them on free. A CPU forward allocates and frees hundreds of activation
tensors of megabytes each, so every step page-faults its whole working set in again: about 30,000 minor
faults and 100-150 ms of kernel time per 3,000-token record on the hidden-256 benchmark release, 7-9% of
its wall time. Raising the mmap threshold to glibc's maximum (32 MiB on 64-bit) and the trim threshold to
1 GiB keeps those blocks in the heap: the process holds on to its peak working set (it would reuse it on
the next step anyway) and a step faults nothing in.

What a thread's heap keeps, though, is only what it has already grown to. A prefix cache filling up retains
snapshots and hidden rows between the activation blocks, so the heap grows by the cache's size, page by
fresh page, inside the steps that fill it (4,000-41,000 faults and 0.1-0.25 s of kernel time per round of 16
fresh mixed records on the hidden-256 release). :func:`prefault_heap` grows the engine thread's heap to
that size before serving, so filling the cache reuses pages that are already there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30
# below the mmap threshold (so they come from the heap), and small enough that a 64 MiB heap of a thread's
# arena is filled by them rather than left with a gap at its end
PREFAULT_CHUNK_BYTES = 8 << 20
PREFAULT_MAX_BYTES = TRIM_THRESHOLD_BYTES  # more would be handed back at the next free anyway

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the thresholds once per process; True where they took effect (Linux with glibc)."""
    global _applied
    if _applied is None:
        _applied = _set_thresholds()
    return _applied


def _set_thresholds() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    log.debug("host malloc thresholds %s", "set" if applied else "refused")
    return applied


def prefault_heap(nbytes: int) -> int:
    """Grow the calling thread's heap by up to ``nbytes`` (at most :data:`PREFAULT_MAX_BYTES`), with every
    page written, then free it again: the kept thresholds leave the pages in the heap, where this thread's
    later tensors find them. Returns the bytes faulted in: 0 where the thresholds did not take effect (the
    pages would go straight back to the kernel).

    The chunks are tensors, allocated as the forward's own are: chunks taken with ``malloc`` through ctypes
    left 4x more of a later working set to fault in (measured, glibc 2.35)."""
    if nbytes <= 0 or not keep_freed_memory():
        return 0
    count = min(nbytes, PREFAULT_MAX_BYTES) // PREFAULT_CHUNK_BYTES
    chunks = [torch.zeros(PREFAULT_CHUNK_BYTES, dtype=torch.uint8) for _ in range(count)]
    del chunks
    return count * PREFAULT_CHUNK_BYTES

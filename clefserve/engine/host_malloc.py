"""Keep freed host memory for reuse instead of handing it back to the kernel after every step.

glibc serves allocations above its mmap threshold (128 KiB, growing only as far as blocks are freed) with
fresh ``mmap`` pages and unmaps them on free. A CPU forward allocates and frees hundreds of activation
tensors of megabytes each, so every step page-faults its whole working set in again: about 30,000 minor
faults and 100-150 ms of kernel time per 3,000-token record on the hidden-256 benchmark release, 7-9% of
its wall time. Raising the mmap threshold to glibc's maximum (32 MiB on 64-bit) and the trim threshold to
1 GiB keeps those blocks in the heap: the process holds on to its peak working set (it would reuse it on
the next step anyway) and a step faults nothing in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30

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

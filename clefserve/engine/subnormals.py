"""Subnormal floats flushed to zero on the engine's thread and its OpenMP team (CPU).

A float below ~1.2e-38 is subnormal, and x86 cores compute with one through a microcode assist, tens to
hundreds of cycles per operation. Trained Gated DeltaNet layers produce such numbers: their decays reach tens
per token, so within a 64-token chunk the decay factors and the keys, queries and values scaled by them fall
below that range, and the delta rule's matmuls and triangular solve slow down several times (a 1,024-token
``clef256`` piece with Qwen3.5's decays, 2 threads: 12.9 ms against 4.9 ms flushed; with the mild decays of
our random test releases nothing changes). Flushing (x86's FTZ and DAZ) makes them 0: what changes is below
1.2e-38 in magnitude, and rounding to the results' precision absorbs it (the outputs compared equal to the
bit in those measurements).

``torch.set_flush_denormal`` sets the calling thread's floating-point control register only; an OpenMP
team's workers copy that register from the thread that creates the team (Linux copies a new thread's
floating-point state from its creator), so it is set before that thread's first parallel region, or the
existing team is released to be rebuilt.
"""

from __future__ import annotations

import torch

from clefserve.engine.openmp import release_thread_team


def flush_subnormals_here() -> bool:
    """Flush subnormals on the calling thread and the OpenMP team it uses from now on; False where the CPU
    cannot (then nothing changes)."""
    if not torch.set_flush_denormal(True):
        return False
    release_thread_team()  # a team built before now would keep the old register
    return True

"""Intra-op threads of the engine on a CPU, chosen once for the model and the step size.

A step of a small model (the demo, the tests' releases) is thousands of small ops; with two or more
intra-op threads each of them forks and joins a thread team, and while another Python thread of the process
(the HTTP loop, ``clef-serve batch``'s reader) holds a core, every join waits for it. Measured on a 2-core
CPU: the demo model answered 400 tickets through ``clef-serve batch`` at 38-40 records/s with one thread
against 16-20 with two, while a 1,024-token prefill of the hidden-256 benchmark model took 270 ms with one
and 150-180 ms with two. So an engine whose largest step (``--prefill-chunk-size`` tokens) is small runs on
one thread, and a larger one on all of them (``OMP_NUM_THREADS`` or the cores). A step's GEMMs grow with
tokens x hidden size squared, which is what is compared.

Chosen once, not per step: a CPU kernel may sum in another order with another thread count, and a
sequence's numbers must not depend on the size of the step it ran in (batch invariance, bit for bit).
"""

from __future__ import annotations

import torch

# tokens x hidden size^2 from which the engine keeps every thread: 1,024-token steps at hidden 256 (6.7e7) do,
# at hidden 96 (9.4e6; two threads measured no faster when idle, and twice slower beside a busy thread) not
PARALLEL_WORK = 1 << 25


class EngineThreads:
    def __init__(self, hidden_size: int, step_tokens: int, device: torch.device) -> None:
        self.available = torch.get_num_threads()
        work = hidden_size**2 * step_tokens
        self.small = device.type == "cpu" and self.available > 1 and work < PARALLEL_WORK
        self.count = 1 if self.small else self.available

    def describe(self) -> str:
        if self.small:
            return (f"1 intra-op thread of {self.available} (steps of this model are too small to share: "
                    f"--prefill-chunk-size x hidden size^2 < {PARALLEL_WORK:,})")
        return f"{self.count} intra-op thread{'s' if self.count > 1 else ''}"

    def apply(self) -> None:
        """On the calling thread (a CPU's thread setting is partly per thread): the engine's constructor and
        its loop, so that the model's math runs under one setting wherever it runs."""
        if self.small:
            torch.set_num_threads(self.count)

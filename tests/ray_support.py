"""Imported by the Ray actors of tests/test_batch_http.py (the repository root is on their path)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from clefserve.ray import ClefDecisions

RENDEZVOUS_ENV = "CLEF_TEST_RAY_RENDEZVOUS"
ACTORS = 2
RENDEZVOUS_TIMEOUT_S = 120.0


class PidDecisions(ClefDecisions):
    """ClefDecisions that also says which process (actor) answered each row.

    Ray Data hands each block to the least busy actor, so an actor that finishes its blocks quickly can be
    handed every block while the other sits idle (CI saw it). The first batch of each actor therefore waits
    until every actor holds a batch: while one waits, the next block goes to an actor with nothing in flight.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._met = False

    def _meet(self) -> None:
        rendezvous = Path(os.environ[RENDEZVOUS_ENV])
        (rendezvous / str(os.getpid())).touch()
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while len(list(rendezvous.iterdir())) < ACTORS and time.monotonic() < deadline:
            time.sleep(0.05)
        self._met = True

    def __call__(self, batch: Any) -> Any:
        if not self._met:
            self._meet()
        out = super().__call__(batch)
        out["pid"] = np.full(len(out["status"]), os.getpid())
        return out

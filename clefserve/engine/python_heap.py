"""Keep what a server loads at startup out of Python's full garbage collections.

CPython's cyclic collector stops every thread for the length of a collection: it holds the GIL, and the
engine's lanes need the GIL between any two torch ops. A full (generation 2) collection walks every tracked
object, and a loaded server tracks ~175,000 (torch's, FastAPI's and pydantic's functions, types and dicts;
the weights are tensors, not tracked objects): 60-85 ms on the 2-core benchmark host. Request handling
allocates enough (the JSON of long records, their encodings) to run one every few bursts, so a short record
that arrived with a burst of long ones waited ~85 ms more, measured in a traced burst on ``clef256``.

None of those objects is garbage: the server keeps them until it exits. ``gc.freeze()`` moves them to the
permanent generation, which collections skip; a full collection then walks only what requests created since
(about a millisecond). A frozen object still goes when its last reference does; only one that becomes part
of unreachable reference cycles later is never collected, so the freeze comes once, after loading, and only
in processes that serve until they exit (``serve``, ``batch``, a Ray actor; not the tests' engines).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_loaded_objects() -> int:
    """Collect once, then freeze every object that survived (call when loading is done); returns how many
    objects are frozen."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("python heap: %d loaded objects frozen out of the garbage collector's passes (%.2f s)",
             frozen, time.perf_counter() - started)
    return frozen

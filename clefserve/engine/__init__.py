"""The serving engine: continuous batching with chunked prefill over a paged KV pool and a GDN state pool.

It knows nothing about any model format: it runs token ids through a :class:`~clefserve.model.Backbone`
and hands each finished sequence's hidden rows to a ``finish`` callback.
"""

from clefserve.engine.engine import Engine
from clefserve.engine.errors import EngineClosedError, QueueFullError, StepError
from clefserve.engine.memory import PoolPlan, plan_pools
from clefserve.engine.sequence import FinishedSequence

__all__ = [
    "Engine",
    "EngineClosedError",
    "FinishedSequence",
    "PoolPlan",
    "QueueFullError",
    "StepError",
    "plan_pools",
]

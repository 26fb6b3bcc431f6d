"""HTTP layer: the System One API over a DecisionBackend."""

from clefserve.server.app import create_app
from clefserve.server.backend import DecisionBackend
from clefserve.server.threaded import ThreadedBackend

__all__ = ["DecisionBackend", "ThreadedBackend", "create_app"]

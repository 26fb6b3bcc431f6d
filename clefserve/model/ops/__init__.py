"""Numerical kernels of the backbone behind one small interface.

Every op has a plain torch reference (``reference``) that runs on any device. Faster implementations fill
the same :class:`Ops` fields and are compared against the reference by the tests and the startup check.
"""

from clefserve.model.ops.interface import Ops, reference_ops

__all__ = ["Ops", "reference_ops"]

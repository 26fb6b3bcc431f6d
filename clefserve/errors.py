"""Errors shared across the package."""


class ReleaseError(ValueError):
    """A release folder cannot be loaded: one message naming the file, tensor or setting at fault."""

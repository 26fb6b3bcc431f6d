"""Errors shared across the package."""


class ReleaseError(ValueError):
    """A release folder cannot be loaded: one message naming the file, tensor or setting at fault."""


class RequestError(ValueError):
    """A request the server must refuse with a 4xx (never a 5xx: clients retry those).

    ``error_type`` follows the System One error body ``{"detail": {"message", "error_type"}}``.
    """

    def __init__(self, message: str, status: int = 422, error_type: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type


class StartupError(RuntimeError):
    """The server cannot start as configured (device, dtype, kernels, memory); the message says why and
    states the sizes or settings involved."""

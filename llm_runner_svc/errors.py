"""Typed errors. Each carries the name of the gRPC status code it maps to.

The library never imports grpc; the servicer's interceptor turns `code` into a
`grpc.StatusCode` of the same name. Anything that is not a `RunnerError` is a bug
and surfaces as INTERNAL.
"""

from __future__ import annotations


class RunnerError(Exception):
    """Base of every error this package raises on purpose."""

    code = "UNKNOWN"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(RunnerError):
    """The request or configuration is malformed (bad value, out of range)."""

    code = "INVALID_ARGUMENT"


class NotFound(RunnerError):
    """A named thing (model path, slot, adapter) does not exist."""

    code = "NOT_FOUND"


class FailedPrecondition(RunnerError):
    """The call is not legal in the current state."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(RunnerError):
    """A queue, the batch or the KV pool is full."""

    code = "RESOURCE_EXHAUSTED"


class Unimplemented(RunnerError):
    """A feature or format this build cannot honour."""

    code = "UNIMPLEMENTED"


class ModelFormatError(InvalidArgument):
    """A model file exists but is not a valid checkpoint of the format it claims."""


class Unavailable(RunnerError):
    """The service is draining or a dependency is down; retry elsewhere or later."""

    code = "UNAVAILABLE"


class Internal(RunnerError):
    """A bug: an invariant broke. Never raised for bad input."""

    code = "INTERNAL"

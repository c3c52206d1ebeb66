"""Typed errors of the runner: the shared hierarchy of services/errors.py (grpc-free), under
the names this package has always used, plus the runner's own ModelFormatError.

`RunnerError` is `ServiceError`: every error raised on purpose carries the name of its gRPC
status in its class's `code`, which the server's interceptor turns into that status. Anything
that is not one of these is a bug and surfaces as INTERNAL.
"""

from __future__ import annotations

from services.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    Unimplemented,
    error_for,
)

RunnerError = ServiceError


class ModelFormatError(InvalidArgument):
    """A model file exists but is not a valid checkpoint of the format it claims."""


__all__ = [
    "AlreadyExists", "Cancelled", "DeadlineExceeded", "FailedPrecondition", "Internal",
    "InvalidArgument", "ModelFormatError", "NotFound", "PermissionDenied", "ResourceExhausted",
    "RunnerError", "ServiceError", "Unavailable", "Unimplemented", "error_for",
]

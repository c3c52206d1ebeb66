"""Typed errors shared by every package; no grpc here.

Each class names, in its class attribute `code`, the gRPC status it maps to (e.g.
"INVALID_ARGUMENT"); `services.interceptor` turns a raised `ServiceError` into that status with
its message. Anything that is not a `ServiceError` is a bug and surfaces as INTERNAL. `code`
belongs to the class: an error of another status is another class (`error_for` picks it from a
status name), never an instance whose `code` was rewritten.
"""

from __future__ import annotations

from typing import ClassVar


class ServiceError(Exception):
    """Base of every error raised on purpose. As itself: a failure whose status no subclass
    names (UNKNOWN)."""

    code: ClassVar[str] = "UNKNOWN"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    """The request or configuration is malformed (bad value, out of range)."""

    code = "INVALID_ARGUMENT"


class NotFound(ServiceError):
    """A named thing (model path, slot, adapter, request) does not exist."""

    code = "NOT_FOUND"


class FailedPrecondition(ServiceError):
    """The call is not legal in the current state."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(ServiceError):
    """A queue, the batch or the KV pool is full."""

    code = "RESOURCE_EXHAUSTED"


class Unimplemented(ServiceError):
    """A feature or format this build cannot honour."""

    code = "UNIMPLEMENTED"


class Unavailable(ServiceError):
    """The service is draining or a dependency is down; retry elsewhere or later."""

    code = "UNAVAILABLE"


class AlreadyExists(ServiceError):
    """Something with that name (a request id) is already there."""

    code = "ALREADY_EXISTS"


class DeadlineExceeded(ServiceError):
    """The caller's deadline passed before the work was done."""

    code = "DEADLINE_EXCEEDED"


class Cancelled(ServiceError):
    """The caller (or a peer on its behalf) cancelled the work."""

    code = "CANCELLED"


class PermissionDenied(ServiceError):
    """The caller may not make this call (an admin call without the admin token)."""

    code = "PERMISSION_DENIED"


class Internal(ServiceError):
    """A bug: an invariant broke. Never raised for bad input."""

    code = "INTERNAL"


_BY_CODE: dict[str, type[ServiceError]] = {cls.code: cls for cls in (
    InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Unimplemented,
    Unavailable, AlreadyExists, DeadlineExceeded, Cancelled, PermissionDenied, Internal)}


def error_for(code: str, message: str) -> ServiceError:
    """The error of the class that names status `code` (a gRPC status name such as
    "NOT_FOUND"); a status no class names gives a plain ServiceError (UNKNOWN) whose message
    starts with that name."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return ServiceError(f"{code}: {message}")
    return cls(message)

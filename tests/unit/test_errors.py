"""One error hierarchy for every package: grpc-free, each class naming its gRPC status, a
status name mapped back to its class, and the interceptor's mapping of both kinds of error."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from llm_runner_svc import errors as runner_errors
from services import errors
from services.interceptor import status_for


def test_the_runner_names_are_the_shared_classes():
    assert runner_errors.RunnerError is errors.ServiceError
    for name in ("InvalidArgument", "NotFound", "FailedPrecondition", "ResourceExhausted",
                 "Unimplemented", "Unavailable", "Internal"):
        assert getattr(runner_errors, name) is getattr(errors, name)
    assert issubclass(runner_errors.ModelFormatError, errors.InvalidArgument)
    assert runner_errors.ModelFormatError("x").code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("cls", [errors.InvalidArgument, errors.NotFound,
                                 errors.FailedPrecondition, errors.ResourceExhausted,
                                 errors.Unimplemented, errors.Unavailable,
                                 errors.DeadlineExceeded, errors.Cancelled, errors.Internal])
def test_a_status_name_gives_the_class_that_names_it(cls):
    err = errors.error_for(cls.code, "why")
    assert type(err) is cls and err.message == "why"
    assert cls.code in grpc.StatusCode.__members__
    assert status_for(err) == (grpc.StatusCode[cls.code], "why")


def test_a_status_no_class_names_stays_unknown_and_keeps_its_name():
    err = errors.error_for("DATA_LOSS", "no")
    assert type(err) is errors.ServiceError and err.code == "UNKNOWN"
    assert err.message == "DATA_LOSS: no"
    assert status_for(err) == (grpc.StatusCode.UNKNOWN, "DATA_LOSS: no")


def test_anything_else_is_internal():
    code, message = status_for(KeyError("k"))
    assert code is grpc.StatusCode.INTERNAL and "KeyError" in message


def test_the_errors_import_no_grpc():
    probe = ("import sys, llm_runner_svc.errors, services.errors; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc'))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"

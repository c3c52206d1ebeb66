"""Shared fixtures: the embedded model and a runtime over the numpy engine."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import make_runtime

from llm_runner_svc.models import Model, load_model
from llm_runner_svc.runtime import InferenceRuntime

DATA = Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def _no_exec_in_the_test_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that replaces the process (os.exec*) would end the whole run there, with the
    exit status of whatever it started and no summary: in a test it raises instead. A test of
    such a call patches the one it expects over this."""
    def refuse(*args: object) -> None:
        raise AssertionError(f"a test tried to replace the test process: os.exec*{args!r}")
    for name in ("execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp",
                 "execlpe"):
        monkeypatch.setattr(os, name, refuse)


@pytest.fixture(scope="session")
def stories() -> Model:
    return load_model()


@pytest.fixture(scope="session")
def goldens() -> dict:
    return json.loads((DATA / "goldens" / "stories260K.json").read_text())


@pytest.fixture
def runtime(stories: Model) -> Iterator[InferenceRuntime]:
    rt = make_runtime(stories, max_batch=8, max_seq=512)
    yield rt
    rt.close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With LLM_TEST_SESSION_FILE set (.ci/run), write the run's test count and status there:
    a run cut short by something that ended the process gives no file, which CI can tell
    from a run that finished."""
    path = os.environ.get("LLM_TEST_SESSION_FILE")
    if path:
        Path(path).write_text(f"{session.testscollected} {int(exitstatus)}\n")

"""Shared fixtures: the embedded model and a runtime over the numpy engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import make_runtime

from llm_runner_svc.models import Model, load_model
from llm_runner_svc.runtime import InferenceRuntime

DATA = Path(__file__).parent / "data"


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

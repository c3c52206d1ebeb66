"""Contract tests: the Stage service over real gRPC on a loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from stage_harness import StageServer


@pytest.fixture(scope="module")
def server() -> Iterator[StageServer]:
    with StageServer() as srv:
        yield srv

"""Reliability tests: real runner, orchestrator and talker processes on loopback, with the
runner's fault hook switched on and every service's counters checked after each ending."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rig import Rig


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("rig"))
    yield r
    r.close()

"""Integration tests: several real processes on loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from deployment import Deployment


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    dep = Deployment(tmp_path_factory.mktemp("dep"), {"backbone": {"maxSeq": 512}})
    yield dep
    dep.close()


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path

"""A hook that lets a caller watch a model load: the loaders report the bytes of tensors they
read, the caller (a CLI with a progress bar) decides what to show.

Loading does not change with or without a watcher: with none installed `start`/`advance` do
nothing. The watcher lives in a context variable, so concurrent loads on other threads or
tasks do not see each other's watcher.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol


class LoadWatcher(Protocol):
    """Told, in order: `start(total_bytes, what)` once per loader, then `advance(num_bytes)`
    as tensors are read. Called on the loading thread; must not raise."""

    def start(self, total_bytes: int, what: str) -> None: ...

    def advance(self, num_bytes: int) -> None: ...


_WATCHER: ContextVar[LoadWatcher | None] = ContextVar("model_load_watcher", default=None)


@contextmanager
def watching(watcher: LoadWatcher | None) -> Iterator[None]:
    """Installs `watcher` for the loads run inside the block (None: nobody watches)."""
    token = _WATCHER.set(watcher)
    try:
        yield
    finally:
        _WATCHER.reset(token)


def start(total_bytes: int, what: str) -> None:
    """A loader is about to read `total_bytes` of tensors of `what` (a file name)."""
    watcher = _WATCHER.get()
    if watcher is not None:
        watcher.start(total_bytes, what)


def advance(num_bytes: int) -> None:
    """A loader has read `num_bytes` more."""
    watcher = _WATCHER.get()
    if watcher is not None:
        watcher.advance(num_bytes)


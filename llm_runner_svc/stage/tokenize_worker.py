"""Admit's tokenization (and the compiling of a structured output) off the event loop: one
worker thread, and the slot ids whose Admit is waiting on it.

While a prompt is tokenized the event loop keeps serving (health, Describe, every other
slot's calls). The slot is not created until tokenization ends, so nothing else can see it;
`claim` keeps a second Admit of the same slot id out meanwhile. The work is bounded: each
prompt (and schema or grammar) is capped in bytes before it gets here, and the stage counts
the Admits in progress against its capacity, so the queue in front of the thread is too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from llm_runner_svc.errors import FailedPrecondition

T = TypeVar("T")


class TokenizeWorker:
    """Call `close()` when done. Runs on the event loop thread except for `run`'s work."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._claimed: set[int] = set()

    @property
    def num_pending(self) -> int:
        """Admits that have claimed their slot id and not yet ended."""
        return len(self._claimed)

    def claim(self, slot_id: int) -> None:
        """Reserve `slot_id` for one Admit; FailedPrecondition while another one holds it."""
        if slot_id in self._claimed:
            raise FailedPrecondition(
                f"Admit is not allowed: slot {slot_id} is being admitted by another call")
        self._claimed.add(slot_id)

    def release(self, slot_id: int) -> None:
        self._claimed.discard(slot_id)

    async def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on the worker thread. A caller that is cancelled stops waiting; the work
        already started runs to its end and its result is dropped."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def close(self) -> None:
        """Drop queued work and let the thread end. Idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)

"""One request's buffer of member updates: what its stages streamed and its reader has not
taken yet, in arrival order.

The cohort streams write it (`put`), the request's run reads it (`get`, `peek`, `take`). It
keeps two counts per stage of the updates that spent one of the member's credits on the
stage (`spends_credit`): those waiting, which the stage's member window bounds, and those
taken since the run last handed credits back (`take_consumed`). `Scores` gathers the
log-probabilities of the updates one delta joins.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.errors import ServiceError

# (stage id, one member update or the error that ends the request on that stage)
Item = tuple[str, "pb.MemberUpdate | ServiceError"]


def spends_credit(update: pb.MemberUpdate | ServiceError) -> bool:
    """Whether the stage spent one of the member's credits on `update`: an update that
    carries tokens does, the one that ends the member does not (see
    StepRequest.member_credits)."""
    return (isinstance(update, pb.MemberUpdate) and update.status != pb.MEMBER_STATUS_ENDED
            and len(update.token_ids) > 0)


class UpdateBuffer:
    """FIFO of one request's updates from every stage of its route (event loop only)."""

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._waiting: Counter[str] = Counter()  # credit-spending updates not taken, by stage
        self._consumed: Counter[str] = Counter()  # ... taken since the last take_consumed
        self._ready = asyncio.Event()
        # Since when (monotonic clock, as the event loop's) the item at the head has waited
        # (the last change of head when several wait: a lower bound), and how long the item
        # last taken waited.
        self._head_since = 0.0
        self.head_wait_s = 0.0

    def __len__(self) -> int:
        return len(self._items)

    def num_waiting(self, stage_id: str) -> int:
        """Updates of `stage_id` waiting here that spent a member credit."""
        return self._waiting[stage_id]

    def put(self, item: Item) -> None:
        if not self._items:
            self._head_since = time.monotonic()
        self._items.append(item)
        if spends_credit(item[1]):
            self._waiting[item[0]] += 1
        self._ready.set()

    def peek(self) -> Item | None:
        """The next item, left in place; None when empty."""
        return self._items[0] if self._items else None

    def take(self) -> Item:
        """Remove and return the next item (there must be one)."""
        item = self._items.popleft()
        now = time.monotonic()
        self.head_wait_s, self._head_since = now - self._head_since, now
        if spends_credit(item[1]):
            self._waiting[item[0]] -= 1
            self._consumed[item[0]] += 1
        return item

    async def get(self) -> Item:
        """The next item, waiting for one."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self.take()

    def take_consumed(self) -> dict[str, int]:
        """Credit-spending updates taken since the last call, by stage; resets the count."""
        consumed = {sid: n for sid, n in self._consumed.items() if n}
        self._consumed.clear()
        return consumed


@dataclass
class Scores:
    """The log-probabilities of the updates one delta gathers: each update's `logprobs` in
    the order of their token ids, and the prompt's, which one update of the request carries."""

    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: Sequence[pb.TokenLogprob] = ()

    @classmethod
    def of(cls, update: pb.MemberUpdate) -> Scores:
        scores = cls()
        scores.add(update)
        return scores

    def add(self, update: pb.MemberUpdate) -> None:
        self.logprobs.extend(update.logprobs)
        if update.prompt_logprobs:
            self.prompt_logprobs = update.prompt_logprobs

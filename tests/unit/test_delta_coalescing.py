"""Orchestrator deltas for a caller that reads slower than the stages step: the updates of the
same stage already waiting are gathered into one delta; another stage's update, an ending or
an error is kept for the next read, in order."""

from __future__ import annotations

import asyncio

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.errors import Unavailable
from services.orchestrator.routes import Route
from services.orchestrator.run import MAX_TOKENS_PER_DELTA, RequestRun

RUNNING, ENDED = pb.MEMBER_STATUS_RUNNING, pb.MEMBER_STATUS_ENDED


def _run(*items) -> RequestRun:
    run = RequestRun("r", pb.GenerationRequest(), Route(("llm", "talker"), ("llm:text",)), [],
                     None)
    for item in items:
        run._updates.put(item)
    return run


def _update(tokens: list[int], text: str, status=RUNNING) -> pb.MemberUpdate:
    return pb.MemberUpdate(slot_id=1, status=status, token_ids=tokens, text=text)


def test_waiting_updates_of_the_stage_join_the_delta():
    run = _run(("llm", _update([2], "b")), ("llm", _update([3, 4], "cd")))
    assert run._coalesce("llm", [1], "a") == ([1, 2, 3, 4], "abcd")
    assert not len(run._updates)


def test_another_stage_an_ending_or_an_error_is_kept_for_the_next_read():
    talker = ("talker", _update([9], ""))
    ending = ("llm", _update([5], "e", ENDED))
    failure = ("llm", Unavailable("replica gone"))
    later = ("llm", _update([6], "f"))
    for stop in (talker, ending, failure):
        run = _run(("llm", _update([2], "b")), stop, later)
        assert run._coalesce("llm", [1], "a") == ([1, 2], "ab")
        assert asyncio.run(run._next_update()) is stop
        assert asyncio.run(run._next_update()) is later


def test_a_delta_gathers_at_most_its_cap():
    run = _run(*[("llm", _update([i], "x")) for i in range(MAX_TOKENS_PER_DELTA + 10)])
    tokens, _ = run._coalesce("llm", [], "")
    assert len(tokens) == MAX_TOKENS_PER_DELTA
    assert len(run._updates) == 10

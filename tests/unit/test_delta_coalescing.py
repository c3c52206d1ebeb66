"""Orchestrator deltas for a caller that reads slower than the stages step: the updates of the
same stage already waiting are gathered into one delta, their log-probabilities one per token
in the same order and the prompt's once; another stage's update, an ending or an error is kept
for the next read, in order."""

from __future__ import annotations

import asyncio

import pytest

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.errors import Unavailable
from services.orchestrator.codec import Delta
from services.orchestrator.routes import Route
from services.orchestrator.run import MAX_TOKENS_PER_DELTA, RequestRun
from services.orchestrator.updates import Scores

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


def _scored(tokens: list[int], prompt: tuple[int, ...] = (), status=RUNNING) -> pb.MemberUpdate:
    """An update whose every token has a log-probability (-token / 10, the token itself the
    likeliest), and the prompt's when given."""
    def lp(t: int) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=t, logprob=-t / 10, top_ids=[t], top_logprobs=[-t / 10])
    return pb.MemberUpdate(slot_id=1, status=status, token_ids=tokens, text="x" * len(tokens),
                           logprobs=[lp(t) for t in tokens],
                           prompt_logprobs=[lp(t) for t in prompt])


def test_coalesced_logprobs_follow_their_tokens_and_the_prompts_come_once():
    first = _scored([1, 2], prompt=(7, 8, 9))
    run = _run(("llm", _scored([3])), ("llm", _scored([4, 5])), ("llm", _scored([6], (), ENDED)))
    scores = Scores.of(first)
    tokens, text = run._coalesce("llm", list(first.token_ids), first.text, scores)
    assert tokens == [1, 2, 3, 4, 5] and text == "xxxxx"
    assert [lp.token_id for lp in scores.logprobs] == tokens  # one per token, in order
    assert [lp.logprob for lp in scores.logprobs] == pytest.approx([-0.1, -0.2, -0.3, -0.4,
                                                                    -0.5])
    assert [lp.token_id for lp in scores.prompt_logprobs] == [7, 8, 9]
    delta = Delta("llm", "text", tokens, text, scores.logprobs,
                  scores.prompt_logprobs).to_pb().delta
    assert [lp.token_id for lp in delta.logprobs] == list(delta.token_ids)
    assert [lp.token_id for lp in delta.prompt_logprobs] == [7, 8, 9]
    # the ending stays for the next read, with its own token's log-probability
    _, ending = asyncio.run(run._next_update())
    assert [lp.token_id for lp in ending.logprobs] == list(ending.token_ids) == [6]


def test_a_later_delta_carries_no_prompt_logprobs():
    run = _run(("llm", _scored([4])))
    scores = Scores.of(_scored([3]))
    run._coalesce("llm", [3], "x", scores)
    assert [lp.token_id for lp in scores.logprobs] == [3, 4]
    assert not scores.prompt_logprobs
    delta = Delta("llm", "text", [3, 4], "xx", scores.logprobs).to_pb().delta
    assert len(delta.logprobs) == 2 and not delta.prompt_logprobs


def test_a_delta_without_logprobs_encodes_none():
    delta = Delta("llm", "text", [1], "a").to_pb().delta
    assert not delta.logprobs and not delta.prompt_logprobs

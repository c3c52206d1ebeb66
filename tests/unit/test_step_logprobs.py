"""Log-probabilities on the Step stream: a run's scores become its MemberUpdate's logprobs and
prompt_logprobs, one per token in order; a member that asked for none carries none, and a step
in which no member asked encodes none."""

from __future__ import annotations

import asyncio

from llm_runner_svc.engines.batch import TokenLogprob
from llm_runner_svc.runtime import StepEvent
from services.stage.codec import event_to_pb
from services.stage.cohort import Cohort, CohortEvent, MemberUpdate
from services.stage.ending import FinishReason
from services.stage.slot import Slot
from services.stage.step_loop import StepLoop

SCORES = [TokenLogprob(5, -0.5, ((5, -0.5), (9, -1.25))), TokenLogprob(7, -2.0)]
PROMPT = [TokenLogprob(3, -4.0, ((1, -0.75),))]


def test_scores_become_member_logprobs_in_token_order() -> None:
    ev = event_to_pb(CohortEvent(3, [
        MemberUpdate(1, False, [5, 7], "ab", logprobs=SCORES, prompt_logprobs=PROMPT),
        MemberUpdate(2, True, [8], "c", FinishReason.MAX_LENGTH),
    ], has_scores=True))
    asked, plain = ev.members
    assert [lp.token_id for lp in asked.logprobs] == list(asked.token_ids) == [5, 7]
    first, second = asked.logprobs
    assert first.logprob == -0.5 and list(first.top_ids) == [5, 9]
    assert list(first.top_logprobs) == [-0.5, -1.25]
    assert second.logprob == -2.0 and not second.top_ids and not second.top_logprobs
    assert [(p.token_id, p.logprob, list(p.top_ids)) for p in asked.prompt_logprobs] == \
        [(3, -4.0, [1])]
    assert not plain.logprobs and not plain.prompt_logprobs  # asked for none
    assert plain.finish_reason and list(plain.token_ids) == [8]


def test_the_step_loop_marks_the_events_that_carry_scores() -> None:
    async def scenario() -> list[CohortEvent]:
        slots = {f"slot-{i}": Slot(i, None) for i in (1, 2, 3)}
        scored, plain = Cohort(64, lambda: None), Cohort(64, lambda: None)
        for slot, cohort in zip(slots.values(), (scored, scored, plain), strict=True):
            cohort.grant(8)
            cohort.add(slot)
            slot.run.cohort = cohort
        loop = StepLoop(None, slots.get, lambda s: None, None)  # type: ignore[arg-type]
        loop._dispatch([
            StepEvent("slot-1", [5, 7], "ab", logprobs=SCORES, prompt_logprobs=PROMPT),
            StepEvent("slot-2", [8], "c"), StepEvent("slot-3", [9], "d")])
        return [await anext(scored.events()), await anext(plain.events())]

    with_scores, without = asyncio.run(scenario())
    assert with_scores.has_scores and not without.has_scores
    one, two = with_scores.members
    assert list(one.logprobs) == SCORES and list(one.prompt_logprobs or ()) == PROMPT
    assert not two.logprobs and two.prompt_logprobs is None
    encoded = event_to_pb(with_scores).members
    assert [lp.token_id for lp in encoded[0].logprobs] == [5, 7] and not encoded[1].logprobs

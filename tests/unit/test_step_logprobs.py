"""Log-probabilities on the Step stream: a run's scores become its MemberUpdate's logprobs and
prompt_logprobs, one per token in order; a member that asked for none carries none."""

from __future__ import annotations

from llm_runner_svc.engines.batch import TokenLogprob
from services.stage.codec import event_to_pb
from services.stage.cohort import CohortEvent, MemberUpdate
from services.stage.ending import FinishReason


def test_scores_become_member_logprobs_in_token_order() -> None:
    scores = [TokenLogprob(5, -0.5, ((5, -0.5), (9, -1.25))), TokenLogprob(7, -2.0)]
    prompt = [TokenLogprob(3, -4.0, ((1, -0.75),))]
    ev = event_to_pb(CohortEvent(3, [
        MemberUpdate(1, False, [5, 7], "ab", logprobs=scores, prompt_logprobs=prompt),
        MemberUpdate(2, True, [8], "c", FinishReason.MAX_LENGTH),
    ]))
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


def test_an_empty_prompt_score_list_is_sent_as_none() -> None:
    ev = event_to_pb(CohortEvent(1, [MemberUpdate(1, False, [5], "a", prompt_logprobs=[])]))
    assert not ev.members[0].prompt_logprobs

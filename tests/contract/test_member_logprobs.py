"""Log-probabilities on the Step stream: one per generated token, in order, with the top k
asked; the prompt's once, on the first update with tokens; none for a member that asked for
none, in the same stream."""

from __future__ import annotations

import math

from helpers import TEST_ENGINE_SCORES
from stage_harness import StageServer

from services.contract.llmstage.v1 import stage_pb2 as pb

PROMPT = "Once upon a time"


def _admit(srv: StageServer, slot_id: int, **kw: object) -> int:
    req = pb.GenerationRequest(text=PROMPT, ignore_eos=True, sampling=pb.SamplingOverrides(
        temperature=0.0, max_tokens=12), **kw)
    ans = srv.stub.Admit(pb.AdmitRequest(slot_id=slot_id, request=req))
    assert ans.admitted, ans.reason
    srv.stub.Prepare(pb.PrepareRequest(slot_id=slot_id))
    return ans.prompt_tokens


def _updates(srv: StageServer, slots: set[int]) -> dict[int, list[pb.MemberUpdate]]:
    """Every update of each slot until all have ended."""
    stream = srv.step(sorted(slots), credits=64)
    out: dict[int, list[pb.MemberUpdate]] = {s: [] for s in slots}
    live = set(slots)
    while live:
        ev = stream.next()
        stream.send(credits=1)
        for m in ev.members:
            out[m.slot_id].append(m)
            if m.status == pb.MEMBER_STATUS_ENDED:
                live.discard(m.slot_id)
    stream.half_close()
    for sid in slots:
        srv.stub.Finish(pb.FinishRequest(slot_id=sid))
        srv.stub.Reset(pb.ResetRequest(slot_id=sid))
    return out


def test_one_logprob_per_token_and_the_prompts_once(server: StageServer) -> None:
    if not TEST_ENGINE_SCORES:  # refused at Admit, naming the field; the rest still holds
        req = pb.GenerationRequest(text=PROMPT, prompt_logprobs=2)
        ans = server.stub.Admit(pb.AdmitRequest(slot_id=9, request=req))
        assert not ans.admitted and ans.refusal == pb.REFUSAL_SAMPLING_OUT_OF_RANGE
        assert "prompt_logprobs" in ans.reason
    num_prompt = _admit(server, 1, logprobs=3,
                        **({"prompt_logprobs": 2} if TEST_ENGINE_SCORES else {}))
    _admit(server, 2)
    got = _updates(server, {1, 2})
    asked, plain = got[1], got[2]
    tokens = [t for m in asked for t in m.token_ids]
    assert len(tokens) == 12
    for m in asked:
        assert [lp.token_id for lp in m.logprobs] == list(m.token_ids)
        for lp in m.logprobs:
            assert len(lp.top_ids) == len(lp.top_logprobs) == 3
            assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
            assert lp.logprob <= 0.0 and math.isfinite(lp.logprob)
            # greedy: the pick is the likeliest token of the raw distribution
            assert lp.token_id == lp.top_ids[0]
            assert math.isclose(lp.logprob, lp.top_logprobs[0], abs_tol=1e-5)
    with_prompt = [m for m in asked if m.prompt_logprobs]
    first_with_tokens = next(m for m in asked if m.token_ids)
    if not TEST_ENGINE_SCORES:
        assert not with_prompt
        assert [t for m in plain for t in m.token_ids] == tokens
        return
    assert with_prompt == [first_with_tokens]
    prompt = with_prompt[0].prompt_logprobs
    assert len(prompt) == num_prompt - 1  # the first token has nothing before it
    assert all(len(p.top_ids) == 2 and p.logprob <= p.top_logprobs[0] + 1e-5 for p in prompt)
    assert all(not m.logprobs and not m.prompt_logprobs for m in plain)
    assert [t for m in plain for t in m.token_ids] == tokens  # same prompt, greedy


def test_logprobs_zero_gives_each_tokens_own_and_no_alternatives(server: StageServer) -> None:
    _admit(server, 3, logprobs=0)
    updates = _updates(server, {3})[3]
    scores = [lp for m in updates for lp in m.logprobs]
    assert [lp.token_id for lp in scores] == [t for m in updates for t in m.token_ids]
    assert scores and all(not lp.top_ids and not lp.top_logprobs for lp in scores)
    assert not any(m.prompt_logprobs for m in updates)

"""The whole lifecycle over gRPC equals the in-process runtime, alone and in a cohort."""

from __future__ import annotations

import pytest
from google.protobuf.json_format import MessageToDict
from helpers import solo
from stage_harness import StageServer

from llm_runner_svc.models import Model
from services.contract.llmstage.v1 import stage_pb2 as pb

REASONS = {pb.FINISH_REASON_END_OF_SEQUENCE: "end_of_sequence",
           pb.FINISH_REASON_MAX_LENGTH: "max_length", pb.FINISH_REASON_STOP_WORDS: "stop_words"}

REQUESTS = [
    dict(text="Once upon a time", temperature=0.0, max_tokens=40),
    dict(text="The dog", temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=60),
    dict(text="Lily and Ben went to the park", temperature=1.0, seed=11, max_tokens=25),
    dict(text="One day", temperature=0.7, top_p=0.5, seed=3, max_tokens=80),
    dict(text="Tom had a red ball", temperature=0.0, max_tokens=15, stop=["."]),
    dict(text="The sun", temperature=1.2, top_k=5, seed=99, max_tokens=50),
    dict(text="A little bird", temperature=0.8, seed=5, max_tokens=33),
    dict(token_ids=[1, 403, 407, 261, 378], temperature=0.6, seed=1234, max_tokens=45),
]


def finish_all(srv: StageServer, slots: list[int]) -> dict[int, tuple[pb.FinishResponse, dict]]:
    out = {}
    for sid in slots:
        fin = srv.stub.Finish(pb.FinishRequest(slot_id=sid))
        diag = MessageToDict(srv.stub.Diagnostics(pb.DiagnosticsRequest(slot_id=sid)).values)
        assert srv.stub.Reset(pb.ResetRequest(slot_id=sid)).existed
        out[sid] = (fin, diag)
    return out


def test_one_request_full_lifecycle(server: StageServer, stories: Model) -> None:
    desc = server.stub.Describe(pb.DescribeRequest())
    assert desc.runner == "llm.backbone" and desc.contract_version == "llmstage.v1"
    assert [p.name for p in desc.emits] == ["text", "tokens"] and desc.max_seq == 512
    before = server.stats()
    prep = server.admit_prepare(0, **REQUESTS[1])
    assert prep.seed == 7 and prep.sampling.top_k == 20
    stream = server.step([0])
    got = stream.collect({0})[0]
    stream.half_close()
    with pytest.raises(StopIteration):
        stream.next()
    fin, diag = finish_all(server, [0])[0]
    tokens, text, reason = solo(stories, REQUESTS[1])
    assert got["tokens"] == tokens and got["text"] == text
    assert list(fin.output_token_ids) == tokens and fin.output_text == text
    assert REASONS[fin.finish_reason] == reason == diag["finish_reason"]
    assert fin.metrics.generated_tokens == len(tokens) and fin.metrics.ttft_ms > 0
    assert diag["tokens_in"] == fin.metrics.prompt_tokens and diag["tokens_out"] == len(tokens)
    assert diag["sampling"]["seed"] == "7" and "timings" in diag
    assert server.wait_idle() == before | {"steps": server.stats()["steps"]}


def test_cohort_of_eight_joining_mid_stream(server: StageServer, stories: Model) -> None:
    for sid, spec in enumerate(REQUESTS):
        server.admit_prepare(100 + sid, **spec)
    stream = server.step([100, 101, 102], credits=4)
    joins = {2: [103, 104], 4: [105], 7: [106, 107]}  # after reading N events
    results: dict[int, dict] = {s: {"tokens": [], "text": "", "reason": None}
                                for s in range(100, 108)}
    live, num_events, steps_seen = set(range(100, 103)), 0, []
    while live or joins:
        ev = stream.next()
        num_events += 1
        steps_seen.append(ev.step)
        stream.send(join=joins.pop(num_events, []), credits=1)
        live |= {s for n, ss in joins.items() for s in ss if n <= num_events}
        for m in ev.members:
            rec = results[m.slot_id]
            rec["tokens"] += m.token_ids
            rec["text"] += m.text
            live.add(m.slot_id)
            if m.status == pb.MEMBER_STATUS_ENDED:
                rec["reason"] = REASONS.get(m.finish_reason)
                live.discard(m.slot_id)
        assert len(ev.members) <= 8
    assert steps_seen == sorted(steps_seen)
    stream.half_close()
    with pytest.raises(StopIteration):
        stream.next()  # the stream ends once the client is done and no member is left
    finished = finish_all(server, list(range(100, 108)))
    for sid, spec in enumerate(REQUESTS):
        tokens, text, reason = solo(stories, spec)
        rec, (fin, diag) = results[100 + sid], finished[100 + sid]
        assert rec["tokens"] == tokens, f"request {sid}"
        assert rec["text"] == text and rec["reason"] == reason
        assert list(fin.output_token_ids) == tokens and diag["finish_reason"] == reason
    assert max(d["max_batch_size"] for _, d in finished.values()) >= 5
    assert server.wait_idle()["slots"] == 0

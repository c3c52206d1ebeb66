"""A caller that stops reading holds only its own request: while it reads nothing, three other
requests on the same Step stream run to the end with their solo outputs, and the stopped
request's stage generates no more than its member window (plus what the transport to the
caller already holds). When it reads again, nothing is missing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from deployment import Deployment, collect, generate_request
from helpers import solo

from llm_runner_svc.models import Model
from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.orchestrator.cohorts import MEMBER_WINDOW

# The stopped caller's HTTP/2 window (no BDP growth), so what the transport can hold for it is
# small and known: at most this many bytes of deltas.
CLIENT_WINDOW_BYTES = 1024
OTHER = dict(max_tokens=400, ignore_eos=True, temperature=0.0)


def _transport_slack() -> int:
    """Deltas the caller's window can hold: each is at least a one-token delta on the wire
    (the message plus gRPC's 5-byte prefix)."""
    smallest = opb.GenerateEvent(delta=opb.Delta(stage_id="backbone", port="text",
                                                 token_ids=[1], text=""))
    return CLIENT_WINDOW_BYTES // (smallest.ByteSize() + 5)


def test_a_caller_that_stops_reading_holds_only_its_own_request(deployment: Deployment,
                                                                 stories: Model) -> None:
    channel = grpc.insecure_channel(deployment.target, options=[
        ("grpc.http2.lookahead_bytes", CLIENT_WINDOW_BYTES), ("grpc.http2.bdp_probe", 0)])
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    try:
        slow = stub.Generate(generate_request("Once upon a time", max_tokens=500,
                                              ignore_eos=True, request_id="slow-reader"),
                             timeout=120)
        first = next(slow)  # it runs; from here on its caller reads nothing
        assert first.HasField("delta")

        prompts = ["The dog", "Lily and Ben", "One day"]
        with ThreadPoolExecutor(3) as pool:
            others = list(pool.map(lambda p: collect(deployment.stub.Generate(
                generate_request(p, **OTHER), timeout=120)), prompts))
        for prompt, (tokens, text, final) in zip(prompts, others, strict=True):
            want_tokens, want_text, _ = solo(stories, dict(text=prompt, **OTHER))
            assert tokens == want_tokens and text == want_text, prompt
            assert final.finish_reason == pb.FINISH_REASON_MAX_LENGTH

        # Stop it where it stands; what the stage generated is what it reports at Finish.
        assert deployment.stub.Cancel(opb.CancelGenerateRequest(request_id="slow-reader"),
                                      timeout=10).found
        tokens, _, final = collect(slow)
        generated = final.diagnostics["backbone"]["tokens_out"]
        assert final.finish_reason == pb.FINISH_REASON_CANCELLED
        assert len(first.delta.token_ids) + len(tokens) == generated  # nothing lost
        # What it may have generated unread: its window, a delta in the orchestrator's hands
        # (up to a window of steps), the deltas the transport holds, and the two steps the
        # stage may have under way when the window empties. The others took 400 steps.
        bound = len(first.delta.token_ids) + 2 * MEMBER_WINDOW + _transport_slack() + 2
        assert generated <= bound < OTHER["max_tokens"] // 2, (generated, bound)
    finally:
        channel.close()
    stats = deployment.all_stages[0].wait_idle()
    assert stats["slots"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]

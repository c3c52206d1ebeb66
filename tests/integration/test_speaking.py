"""The speaking topology: thinker (llm_runner_svc) -> C++ talker (clients/cpp), launched by
`llm-stage up` as real processes. Hidden states reach the talker losslessly, its codec frames
match a Python recomputation, cancel reaches both stages, text-only requests skip the talker."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from deployment import collect, generate_request
from llm_stage_client.hidden import HiddenWindow, PortEnd, subscribe_hidden
from talker_reference import codec_frame, talker_binary

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc, stage_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
SPEAKING = ROOT / "services" / "orchestrator" / "topologies" / "speaking.json"
PROMPTS = ["Once upon a time", "The dog", "Lily and Ben", "One day", "Tom had a red ball",
           "The sun", "A little bird", "There was a girl"]


@pytest.fixture(scope="module")
def speaking() -> Iterator[SimpleNamespace]:
    talker_binary()  # built once (cmake) if .ci/run has not built it
    up = subprocess.Popen([str(Path(sys.executable).parent / "llm-stage"), "up", "--topology",
                           str(SPEAKING), "--port", "0"], stdout=subprocess.PIPE, text=True)
    lines = [up.stdout.readline() for _ in range(3)]
    endpoints = [re.search(r"on ([\d.]+:\d+)", ln).group(1) for ln in lines]
    channel = grpc.insecure_channel(endpoints[2])
    yield SimpleNamespace(thinker=endpoints[0], talker=endpoints[1],
                          stub=orchestrator_pb2_grpc.OrchestratorStub(channel))
    channel.close()
    up.send_signal(signal.SIGINT)
    assert up.wait(30) == 0


class StageWatcher(threading.Thread):
    """A whole-stage subscriber on the thinker: the states it published, per request."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.windows, self.ends = endpoint, {}, {}
        self.subscribed = threading.Event()
        self.start()
        assert self.subscribed.wait(10)

    def run(self) -> None:
        try:
            for m in subscribe_hidden(self.endpoint, None, on_subscribed=self.subscribed.set):
                if isinstance(m, HiddenWindow):
                    self.windows.setdefault(m.request_id, []).append(m)
                elif isinstance(m, PortEnd):
                    self.ends[m.request_id] = m
        except grpc.RpcError:
            pass  # the deployment stopped


def run(speaking: SimpleNamespace, i: int, **kw) -> tuple[list[int], list[int], opb.FinalReport]:
    req = generate_request(PROMPTS[i % 8], seed=i, max_tokens=15 + i, temperature=0.8,
                           request_id=f"speak-{i}", **kw)
    text_tokens, codes, final = [], [], None
    for ev in speaking.stub.Generate(req, timeout=60):
        if ev.HasField("delta"):
            (codes if ev.delta.stage_id == "talker" else text_tokens).extend(ev.delta.token_ids)
        else:
            final = ev.final
    return text_tokens, codes, final


def test_sixteen_requests_lossless_through_the_talker(speaking: SimpleNamespace) -> None:
    watcher = StageWatcher(speaking.thinker)
    threading.Event().wait(0.3)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: run(speaking, i), range(16)))
    for i, (tokens, codes, final) in enumerate(results):
        rid = f"speak-{i}"
        windows = watcher.windows[rid]
        thinker, talker = final.diagnostics["thinker"], final.diagnostics["talker"]
        assert list(final.route) == ["thinker", "talker"]
        assert len(tokens) == thinker["tokens_out"] and tokens
        # the talker got every window (no seq gap) and exactly the bytes the runner computed
        assert talker["seq_gaps"] == 0 and talker["frames"] == len(windows) == len(codes)
        crc = 0
        for w in windows:
            crc = zlib.crc32(w.states.tobytes(), crc)
        assert int(thinker["hidden_states_crc32"]) == crc == int(talker["states_crc32"])
        # one frame per thinker step, equal to the projection recomputed in Python
        assert codes == [codec_frame(w.states[-1]) for w in windows]
        assert talker["finish_reason"] == thinker["finish_reason"]


def test_cancel_ends_the_talker_too(speaking: SimpleNamespace) -> None:
    req = generate_request("Once upon a time", max_tokens=300, ignore_eos=True,
                           request_id="speak-cancel")
    call = speaking.stub.Generate(req, timeout=60)
    others = ThreadPoolExecutor(3).map(lambda i: run(speaking, 20 + i), range(3))
    for ev in call:
        if ev.HasField("delta") and ev.delta.stage_id == "talker":
            break
    assert speaking.stub.Cancel(opb.CancelGenerateRequest(request_id="speak-cancel")).found
    _, _, final = collect(call)
    assert final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert final.diagnostics["talker"]["finish_reason"] == "cancelled"
    assert final.diagnostics["talker"]["frames"] < 300
    for _, codes, other in others:
        assert other.finish_reason != pb.FINISH_REASON_CANCELLED
        assert other.diagnostics["talker"]["frames"] == len(codes) > 0
    with grpc.insecure_channel(speaking.thinker) as ch:
        stats = stage_pb2_grpc.StageStub(ch).Diagnostics(pb.DiagnosticsRequest()).values
        assert stats["slots"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
        assert stats["hidden_subscriptions"] <= 1  # at most a test watcher, no talker left


def test_text_only_requests_skip_the_talker(speaking: SimpleNamespace) -> None:
    with grpc.insecure_channel(speaking.thinker) as ch:
        before = stage_pb2_grpc.StageStub(ch).Diagnostics(pb.DiagnosticsRequest()).values
        req = generate_request("Once upon a time", max_tokens=12, seed=1)
        req.sinks.append("thinker:text")
        tokens, text, final = collect(speaking.stub.Generate(req, timeout=30))
        after = stage_pb2_grpc.StageStub(ch).Diagnostics(pb.DiagnosticsRequest()).values
    assert list(final.route) == ["thinker"] and set(final.diagnostics.keys()) == {"thinker"}
    assert len(tokens) == 12 and text
    assert "hidden_windows" not in final.diagnostics["thinker"]  # no hidden port requested
    assert after["hidden_messages_published"] == before["hidden_messages_published"]

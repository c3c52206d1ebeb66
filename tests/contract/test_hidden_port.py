"""The hidden-state port: lossless and in order over gRPC bytes and shared memory, chunked
under the message limit, with the declared backpressure policy, ending on cancel too."""

from __future__ import annotations

import threading
import time
import zlib

import grpc
import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict
from helpers import make_runtime
from llm_stage_client.hidden import HiddenBlock, HiddenWindow, PortEnd, subscribe_hidden
from stage_harness import StageServer

from llm_runner_svc.models import Model
from llm_runner_svc.runtime import GenerationRequest, resolve
from llm_runner_svc.stage import StageConfig
from llm_runner_svc.stage.faults import Faults, faulty_runtime_factory
from services.contract.llmstage.v1 import stage_pb2 as pb

HIDDEN = StageConfig(max_seq=512, emits=("text", "tokens", "hidden"))
PROMPT = "Once upon a time, in a big forest, there lived a little fox"


def prompt_joined(windows: list, prompt_len: int) -> list:
    """The runtime's windows with the prompt's pieces (one per step that prefilled part of
    it) as one window, as the stage publishes them."""
    pieces = [w for w in windows if w[0] < prompt_len]
    whole = (0, np.concatenate([w[1] for w in pieces]), np.concatenate([w[2] for w in pieces]))
    return [whole, *windows[len(pieces):]]


def reference(stories: Model, seed: int, max_tokens: int, batch: int = 1, index: int = 0,
              max_tokens_per_step: int = 0, is_raw: bool = False) -> tuple[list, str]:
    """The (start_position, embeddings, states) windows the in-process runtime captures for
    the request (run `batch` times at once, as the stage batches them; `index`: which of
    them), the prompt's as one unless `is_raw`, and its finish reason. A prompt's states
    depend on how the step budget cut its prefill (the engine's products round by their row
    count), so each request of a batch has its own reference."""
    rt = make_runtime(stories, max_batch=8, max_seq=512, hidden_layer=-1,
                      max_tokens_per_step=max_tokens_per_step)
    try:
        ids = stories.tokenizer.encode(PROMPT)
        for i in range(batch):
            rt.submit(GenerationRequest(f"ref{i}", ids, resolve(
                rt.config.sampling, temperature=0.8, seed=seed, max_new_tokens=max_tokens),
                capture_hidden=True))
        windows, reason = [], None
        while rt.has_work:
            for ev in rt.step():
                if ev.request_id == f"ref{index}":
                    windows += [(h.start_position, h.embeddings, h.states) for h in ev.hidden]
                    reason = ev.finish_reason or reason
        return (windows if is_raw else prompt_joined(windows, len(ids))), reason.value
    finally:
        rt.close()


class Consumer(threading.Thread):
    """Subscribes at once and returns when the stage has acknowledged; with `pause_after`,
    stops reading after that many messages until `resume` is set."""

    def __init__(self, srv: StageServer, request_id: str, pause_after: int | None = None,
                 **kw) -> None:
        super().__init__(daemon=True)
        self.target, self.request_id, self.kw = f"127.0.0.1:{srv.port}", request_id, kw
        self.pause_after, self.resume = pause_after, threading.Event()
        self.messages: list = []
        self.error: grpc.RpcError | None = None
        self.subscribed = threading.Event()
        self.start()
        assert self.subscribed.wait(10)  # registered before the request starts

    def run(self) -> None:
        # A fixed 64 KiB HTTP/2 window (no BDP growth): what gRPC itself buffers stays small.
        channel = grpc.insecure_channel(self.target, options=[("grpc.http2.bdp_probe", 0)])
        try:
            for msg in subscribe_hidden(self.target, self.request_id, timeout=60,
                                        channel=channel, on_subscribed=self.subscribed.set,
                                        **self.kw):
                self.messages.append(msg)
                if len(self.messages) == self.pause_after:
                    self.resume.wait(30)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            channel.close()


def run_request(srv: StageServer, sid: int, request_id: str, seed: int = 3,
                max_tokens: int = 30, **kw) -> dict:
    srv.admit_prepare(sid, text=PROMPT, temperature=0.8, seed=seed, max_tokens=max_tokens,
                      ports=["text", "hidden"], request_id=request_id, **kw)
    stream = srv.step([sid])
    got = stream.collect({sid})[sid]
    srv.stub.Finish(pb.FinishRequest(slot_id=sid))
    got["diagnostics"] = MessageToDict(
        srv.stub.Diagnostics(pb.DiagnosticsRequest(slot_id=sid)).values)
    srv.stub.Reset(pb.ResetRequest(slot_id=sid))
    stream.half_close()
    return got


def assert_lossless(messages: list, reference_run: tuple[list, str], prompt_len: int) -> None:
    ref, reason = reference_run
    windows = [m for m in messages if isinstance(m, HiddenWindow)]
    assert [m.seq for m in messages] == list(range(len(messages)))  # no gap
    assert isinstance(messages[-1], PortEnd) and messages[-1].finish_reason == reason
    emb = np.concatenate([w.embeddings for w in windows])
    states = np.concatenate([w.states for w in windows])
    assert np.array_equal(emb, np.concatenate([r[1] for r in ref]))  # bit-exact
    assert np.array_equal(states, np.concatenate([r[2] for r in ref]))
    assert [w.start_position for w in windows if not w.is_prefill] == \
        [r[0] for r in ref[1:]]
    assert sum(len(w.token_ids) for w in windows if w.is_prefill) == prompt_len


@pytest.fixture(scope="module")
def hidden_server():
    with StageServer(HIDDEN) as srv:
        yield srv


@pytest.mark.parametrize("shm", [False, True], ids=["grpc-bytes", "shared-memory"])
def test_hidden_states_are_lossless(hidden_server: StageServer, stories: Model,
                                    shm: bool) -> None:
    consumer = Consumer(hidden_server, f"h-{shm}", shared_memory=shm)
    diag = run_request(hidden_server, 1, f"h-{shm}")["diagnostics"]
    consumer.join(30)
    assert consumer.error is None
    crc = 0
    for m in consumer.messages:
        if isinstance(m, HiddenWindow):
            crc = zlib.crc32(m.states.tobytes(), crc)
    assert diag["hidden_states_crc32"] == crc  # what the runner computed is what arrived
    prompt_len = len(stories.tokenizer.encode(PROMPT))
    first = consumer.messages[0]
    assert first.is_prefill and first.states.shape == (prompt_len, 64)
    assert first.token_ids == tuple(stories.tokenizer.encode(PROMPT))
    assert_lossless(consumer.messages, reference(stories, 3, 30), prompt_len)


def test_prefill_window_is_chunked_under_the_message_limit(stories: Model) -> None:
    with StageServer(HIDDEN, max_message_bytes=8192) as srv:
        consumer = Consumer(srv, "chunky")
        run_request(srv, 1, "chunky", max_tokens=5)
        consumer.join(30)
    prefill = [m for m in consumer.messages if isinstance(m, HiddenWindow) and m.is_prefill]
    assert len(prefill) > 1 and all(m.states.nbytes * 2 < 8192 for m in prefill)
    assert_lossless(consumer.messages, reference(stories, 3, 5),
                    len(stories.tokenizer.encode(PROMPT)))


def test_a_prompt_prefilled_over_several_steps_arrives_as_one_window(stories: Model) -> None:
    """With 8 tokens a step the prompt is prefilled in three pieces; subscribers still get
    one prefill window of the whole prompt first, the bytes the runtime captured, and the
    stage holds nothing afterwards."""
    cfg = StageConfig(max_seq=512, emits=("text", "tokens", "hidden"), max_tokens_per_step=8)
    with StageServer(cfg) as srv:
        consumer = Consumer(srv, "pieces")
        diag = run_request(srv, 1, "pieces", max_tokens=5)["diagnostics"]
        held = srv.stats()["hidden_prompt_held_bytes"]
        consumer.join(30)
    assert consumer.error is None and held == 0
    prompt_len = len(stories.tokenizer.encode(PROMPT))
    ref, reason = reference(stories, 3, 5, max_tokens_per_step=8, is_raw=True)
    assert [r[0] for r in ref if r[0] < prompt_len] == [0, 8, 16]  # prefilled in pieces
    first = consumer.messages[0]
    assert first.is_prefill and first.start_position == 0
    assert first.states.shape == (prompt_len, 64)
    assert first.token_ids == tuple(stories.tokenizer.encode(PROMPT))
    assert sum(isinstance(m, HiddenWindow) and m.is_prefill for m in consumer.messages) == 1
    assert_lossless(consumer.messages, (prompt_joined(ref, prompt_len), reason), prompt_len)
    crc = 0
    for m in consumer.messages:
        if isinstance(m, HiddenWindow):
            crc = zlib.crc32(m.states.tobytes(), crc)
    assert diag["hidden_states_crc32"] == crc and diag["hidden_windows"] == 1 + 4


def test_a_request_cancelled_mid_prompt_frees_what_was_held(stories: Model) -> None:
    """A 400-token prompt at 8 tokens a step (each step slowed to 50 ms) is held in pieces;
    cancelled before its last piece, its subscriber gets only its end and nothing stays held."""
    cfg = StageConfig(max_seq=512, emits=("text", "tokens", "hidden"), max_tokens_per_step=8)
    factory = faulty_runtime_factory(Faults(step_delay_ms=50))
    with StageServer(cfg, runtime_factory=factory) as srv:
        consumer = Consumer(srv, "held")
        srv.admit_prepare(7, token_ids=[3 + i % 500 for i in range(400)], max_tokens=5,
                          ports=["hidden"], request_id="held")
        stream = srv.step([7])
        deadline = time.monotonic() + 30
        while (held := srv.stats()["hidden_prompt_held_bytes"]) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        srv.stub.Cancel(pb.CancelRequest(slot_id=7))
        got = stream.collect({7})[7]
        consumer.join(30)
        after = srv.stats()["hidden_prompt_held_bytes"]
        srv.stub.Finish(pb.FinishRequest(slot_id=7))
        srv.stub.Reset(pb.ResetRequest(slot_id=7))
        stream.half_close()
    assert got["reason"] == pb.FINISH_REASON_CANCELLED
    assert 0 < held < 400 * 64 * 4 * 2 and after == 0  # some of the prompt, then nothing
    assert len(consumer.messages) == 1 and isinstance(consumer.messages[0], PortEnd)
    assert consumer.messages[0].finish_reason == "cancelled"


def test_block_policy_holds_the_producer_and_loses_nothing(stories: Model) -> None:
    cfg = StageConfig(max_seq=512, emits=("text", "tokens", "hidden"), hidden_buffer=4)
    with StageServer(cfg) as srv:
        consumer = Consumer(srv, "slow", pause_after=2)
        steps0 = srv.stats()["steps"]
        runner = threading.Thread(target=run_request, args=(srv, 1, "slow"),
                                  kwargs={"max_tokens": 400}, daemon=True)
        runner.start()
        time.sleep(0.5)  # the reader is paused: the producer must be waiting on it
        held = srv.stats()["steps"] - steps0
        consumer.resume.set()
        runner.join(30)
        consumer.join(30)
    # the 64 KiB window (about 100 one-row messages) and our buffer of 4 absorb some steps,
    # not the 400 the request needs
    assert held < 200
    assert consumer.error is None
    assert_lossless(consumer.messages, reference(stories, 3, 400),
                    len(stories.tokenizer.encode(PROMPT)))


def test_disconnect_policy_drops_the_laggard_not_the_request(stories: Model) -> None:
    cfg = StageConfig(max_seq=512, emits=("text", "tokens", "hidden"), hidden_buffer=4,
                      hidden_policy="disconnect")
    with StageServer(cfg) as srv:
        consumer = Consumer(srv, "lag", pause_after=1)
        got = run_request(srv, 1, "lag", max_tokens=400, ignore_eos=True)
        consumer.resume.set()
        consumer.join(30)
    assert len(got["tokens"]) == 400 and got["reason"] == pb.FINISH_REASON_MAX_LENGTH
    assert consumer.error is not None
    assert consumer.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "fell behind" in consumer.error.details()
    seqs = [m.seq for m in consumer.messages]
    assert seqs == list(range(len(seqs)))  # what it did get has no gap


def test_cancel_sends_a_terminal_message(hidden_server: StageServer) -> None:
    consumer = Consumer(hidden_server, "cx")
    hidden_server.admit_prepare(5, text=PROMPT, max_tokens=300, ignore_eos=True,
                                ports=["hidden"], request_id="cx")
    stream = hidden_server.step([5], credits=2)
    stream.next()
    hidden_server.stub.Cancel(pb.CancelRequest(slot_id=5))
    stream.collect({5})
    consumer.join(30)
    end = consumer.messages[-1]
    assert isinstance(end, PortEnd) and end.finish_reason == "cancelled"
    hidden_server.stub.Finish(pb.FinishRequest(slot_id=5))
    hidden_server.stub.Reset(pb.ResetRequest(slot_id=5))
    stream.half_close()


def test_subscribe_errors(server: StageServer, hidden_server: StageServer) -> None:
    cases = [(server, "x", {}, grpc.StatusCode.FAILED_PRECONDITION, "no hidden port"),
             (hidden_server, None, {"port": "audio"}, grpc.StatusCode.INVALID_ARGUMENT, "audio")]
    for srv, rid, kw, code, needle in cases:
        req = pb.SubscribeRequest(port=kw.get("port", "hidden"), request_id=rid or "x")
        with pytest.raises(grpc.RpcError) as err:
            next(srv.stub.Subscribe(req, timeout=10))
        assert err.value.code() == code and needle in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        next(hidden_server.stub.Subscribe(pb.SubscribeRequest(port="hidden"), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("shm", [False, True], ids=["grpc-bytes", "shared-memory"])
def test_whole_stage_subscription_sees_every_request(hidden_server: StageServer,
                                                     stories: Model, shm: bool) -> None:
    consumer = Consumer(hidden_server, None, shared_memory=shm)
    for i, sid in enumerate((21, 22, 23)):
        hidden_server.admit_prepare(sid, text=PROMPT, temperature=0.8, seed=3, max_tokens=30,
                                    ports=["hidden"], request_id=f"all-{shm}-{i}")
    stream = hidden_server.step([21, 22, 23])
    stream.collect({21, 22, 23})
    stream.half_close()
    deadline = time.monotonic() + 20
    while sum(isinstance(m, PortEnd) for m in consumer.messages) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    prompt_len = len(stories.tokenizer.encode(PROMPT))
    for i in range(3):  # the same three rows, prefilled and decoded together
        mine = [m for m in consumer.messages if m.request_id == f"all-{shm}-{i}"]
        assert_lossless(mine, reference(stories, 3, 30, batch=3, index=i), prompt_len)
    for sid in (21, 22, 23):
        hidden_server.stub.Finish(pb.FinishRequest(slot_id=sid))
        hidden_server.stub.Reset(pb.ResetRequest(slot_id=sid))


@pytest.mark.parametrize("shm", [False, True], ids=["grpc-bytes", "shared-memory"])
def test_a_lagging_whole_stage_reader_gets_its_backlog_whole_and_in_order(
        stories: Model, shm: bool) -> None:
    """The reader stops after the first message, so steps pile up and come out several to a
    gRPC message; as blocks, expanded row by row, they are still exactly the reference."""
    with StageServer(HIDDEN) as srv:
        consumer = Consumer(srv, None, pause_after=1, shared_memory=shm, blocks=True)
        sids = (31, 32)
        for i, sid in enumerate(sids):
            srv.admit_prepare(sid, text=PROMPT, temperature=0.8, seed=3, max_tokens=30,
                              ports=["hidden"], request_id=f"lag-{i}")
        stream = srv.step(list(sids))
        stream.collect(set(sids))
        stream.half_close()
        consumer.resume.set()
        deadline = time.monotonic() + 20
        while sum(isinstance(m, PortEnd) for m in consumer.messages) < 2:
            assert time.monotonic() < deadline and consumer.error is None
            time.sleep(0.02)
        for sid in sids:
            srv.stub.Finish(pb.FinishRequest(slot_id=sid))
            srv.stub.Reset(pb.ResetRequest(slot_id=sid))
    blocks = [m for m in consumer.messages if isinstance(m, HiddenBlock)]
    assert blocks and all(b.states.shape == (len(b.request_ids), 64) for b in blocks)
    rows = [w for m in consumer.messages
            for w in (m.windows() if isinstance(m, HiddenBlock) else [m])]
    for i in range(2):
        assert_lossless([m for m in rows if m.request_id == f"lag-{i}"],
                        reference(stories, 3, 30, batch=2, index=i),
                        len(stories.tokenizer.encode(PROMPT)))

"""A real Stage server on a loopback port (its own event loop thread) and sync client helpers.

Tests talk to it only over gRPC, as any client would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from helpers import TEST_ENGINE

from llm_runner_svc.server import create_stage_server, stop_stage_server
from llm_runner_svc.stage import StageConfig
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc
from services.server import ServerOptions


class StageServer:
    """`with StageServer(config) as srv:` starts the service on port 0; `srv.stub` calls it."""

    def __init__(self, config: StageConfig | None = None, slot_ttl_s: float = 600.0,
                 runtime_factory: Any = None, keep_engine: bool = False,
                 **options: Any) -> None:
        """A numpy config runs on the test engine (LLM_TEST_ENGINE) unless `keep_engine`."""
        self.config = config or StageConfig(max_seq=512)
        if self.config.engine == "numpy" and TEST_ENGINE != "numpy" and not keep_engine:
            self.config = dataclasses.replace(self.config, engine=TEST_ENGINE)
        self.options = ServerOptions(port=0, **options)
        self.slot_ttl_s = slot_ttl_s
        self.runtime_factory = runtime_factory

    def __enter__(self) -> StageServer:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.handle, self.stage = self.run(
            create_stage_server(self.config, self.options, self.slot_ttl_s,
                                self.runtime_factory), 120)
        self.port = self.handle.port
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{self.port}",
            options=[("grpc.max_send_message_length", 64 << 20),
                     ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = stage_pb2_grpc.StageStub(self.channel)
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()
        self.run(stop_stage_server(self.handle, self.stage), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ---- client helpers --------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Stage-wide diagnostics (slots, KV pages, steps)."""
        return MessageToDict(self.stub.Diagnostics(pb.DiagnosticsRequest()).values)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """Stats once no slot is left and every KV page is free (or the last seen)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if (s["slots"] == 0 and s["kv_pages_free"] == s["kv_pages_total"]) \
                    or time.monotonic() > deadline:
                return s
            time.sleep(0.02)

    def admit(self, slot_id: int, **request: Any) -> pb.AdmitResponse:
        return self.stub.Admit(pb.AdmitRequest(slot_id=slot_id,
                                               request=make_request(**request)))

    def admit_prepare(self, slot_id: int, **request: Any) -> pb.PrepareResponse:
        ans = self.admit(slot_id, **request)
        assert ans.admitted, ans.reason
        return self.stub.Prepare(pb.PrepareRequest(slot_id=slot_id))

    def step(self, join: list[int], credits: int = 0, **kw: Any) -> StepStream:
        return StepStream(self.stub, join, credits, **kw)


def make_request(text: str | None = None, token_ids: list[int] | None = None,
                 messages: list[tuple[str, str]] | None = None, **kw: Any
                 ) -> pb.GenerationRequest:
    sampling = {k: kw.pop(k) for k in ("temperature", "top_k", "top_p", "max_tokens", "seed")
                if k in kw}
    req = pb.GenerationRequest(sampling=pb.SamplingOverrides(**sampling), **kw)
    if text is not None:
        req.text = text
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    if messages is not None:
        req.messages.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
    return req


class StepStream:
    """A Step call driven from the test thread: `send` joins or grants, `next` reads."""

    def __init__(self, stub: stage_pb2_grpc.StageStub, join: list[int], credits: int,
                 timeout: float | None = None,
                 member_credits: dict[int, int] | None = None) -> None:
        self._out: queue.Queue[pb.StepRequest | None] = queue.Queue()
        self.call = stub.Step(self._requests(), timeout=timeout)
        self.send(join, credits, member_credits)

    def _requests(self) -> Iterator[pb.StepRequest]:
        while True:
            msg = self._out.get()
            if msg is None:
                return
            yield msg

    def send(self, join: list[int] | None = None, credits: int = 0,
             member_credits: dict[int, int] | None = None) -> None:
        self._out.put(pb.StepRequest(
            join=join or [], credits=credits,
            member_credits=[pb.MemberCredit(slot_id=s, credits=n)
                            for s, n in (member_credits or {}).items()]))

    def half_close(self) -> None:
        self._out.put(None)

    def next(self) -> pb.StepEvent:
        return next(self.call)

    def cancel(self) -> None:
        self.call.cancel()
        self._out.put(None)

    def collect(self, slots: set[int], refill: bool = True) -> dict[int, dict[str, Any]]:
        """Read until every slot in `slots` has ENDED; grant one credit per event read."""
        out = {s: {"tokens": [], "text": "", "reason": None, "steps": []} for s in slots}
        live = set(slots)
        while live:
            ev = self.next()
            if refill:
                self.send(credits=1)
            for m in ev.members:
                rec = out.setdefault(m.slot_id, {"tokens": [], "text": "", "reason": None,
                                                 "steps": []})
                rec["tokens"].extend(m.token_ids)
                rec["text"] += m.text
                rec["steps"].append(ev.step)
                if m.status == pb.MEMBER_STATUS_ENDED:
                    rec["reason"] = m.finish_reason
                    live.discard(m.slot_id)
        return out

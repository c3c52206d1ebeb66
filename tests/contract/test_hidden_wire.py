"""The hidden port's wire forms, on the publisher behind a real gRPC server: bfloat16 rows
arrive as their exact bits (or widened exactly), and a reader that lags gets its backlog of
steps several to a message, in order, on both transports."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from llm_stage_client.hidden import HiddenBlock, PortEnd, subscribe_hidden

from llm_runner_svc import codec
from llm_runner_svc.stage.hidden_messages import (
    MAX_STEPS_PER_MESSAGE,
    BatchMessage,
    BlockMessage,
    StepsMessage,
    TensorBytes,
    WireArray,
)
from llm_runner_svc.stage.publish import HiddenPublisher, Subscriber
from llm_runner_svc.stage.shm_budget import ShmBudget
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc
from services.server import ServerOptions, create_server

ROWS, WIDTH, STEPS = 4, 48, 40


class _PublisherServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, publisher: HiddenPublisher, subscribed: asyncio.Event) -> None:
        self.publisher, self.subscribed = publisher, subscribed

    async def Subscribe(self, request: pb.SubscribeRequest, context: Any
                        ) -> AsyncIterator[pb.SubscribeEvent]:
        sub = await self.publisher.subscribe(
            None, request.transport == pb.TRANSPORT_SHARED_MEMORY)
        self.subscribed.set()
        try:
            yield pb.SubscribeEvent(subscribed=pb.Subscribed())
            while (msg := await sub.get()) is not None:
                yield codec.port_message_to_pb(msg)
        finally:
            self.publisher.unsubscribe(sub)


def bf16_steps() -> np.ndarray:
    """[STEPS, 2 (embeddings, states), ROWS, WIDTH] bfloat16 bits, finite values only."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal((STEPS, 2, ROWS, WIDTH), dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


class PublisherServer:
    """An event loop thread serving one HiddenPublisher; `publish_all` sends every step."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.publisher = HiddenPublisher("block", 256, 4 << 20, ShmBudget(1 << 20, 8, 64 << 20))
        self.subscribed = asyncio.Event()
        self.handle = self._run(create_server(ServerOptions(port=0), [
            (stage_pb2_grpc.add_StageServicer_to_server,
             _PublisherServicer(self.publisher, self.subscribed), "llmstage.v1.Stage")]))
        self.target = f"127.0.0.1:{self.handle.port}"

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def publish_all(self, bits: np.ndarray) -> None:
        async def go() -> None:
            await asyncio.wait_for(self.subscribed.wait(), 10)
            for step in range(STEPS):
                emb, st = WireArray(bits[step, 0], "bfloat16"), WireArray(bits[step, 1],
                                                                           "bfloat16")
                self.publisher.begin_step()
                await self.publisher.publish_rows([(f"r{r}", 10 + step, 100 + step,
                                                    emb[r:r + 1], st[r:r + 1])
                                                   for r in range(ROWS)])
                await self.publisher.flush_step()
            self.publisher.begin_step()
            for r in range(ROWS):
                await self.publisher.end(f"r{r}", "max_length", None)
            await self.publisher.flush_step()
        self._run(go())

    def close(self) -> None:
        self._run(self.publisher.close())
        self._run(self.handle.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def server() -> Iterator[PublisherServer]:
    srv = PublisherServer()
    yield srv
    srv.close()


@pytest.mark.parametrize("shm", [False, True], ids=["grpc-bytes", "shared-memory"])
@pytest.mark.parametrize("widen", [False, True], ids=["bits", "widened"])
def test_bf16_rows_arrive_exactly(server: PublisherServer, shm: bool, widen: bool) -> None:
    bits = bf16_steps()
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(subscribe_hidden(
        server.target, None, shared_memory=shm, blocks=True, widen=widen, timeout=30)))
    reader.start()
    server.publish_all(bits)
    deadline = time.monotonic() + 20
    while sum(isinstance(m, PortEnd) for m in got) < ROWS:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server._run(server.publisher.close())
    reader.join(10)
    blocks = [m for m in got if isinstance(m, HiddenBlock)]
    assert len(blocks) == STEPS
    for step, block in enumerate(blocks):
        assert block.request_ids == tuple(f"r{r}" for r in range(ROWS))
        assert block.seqs == (step,) * ROWS and block.positions == (10 + step,) * ROWS
        assert block.token_ids == (100 + step,) * ROWS
        if widen:  # bfloat16 is the high half of a float32
            want = (bits[step].astype(np.uint32) << 16).view(np.float32)
            assert block.states.dtype == np.float32
            assert np.array_equal(block.embeddings, want[0])
            assert np.array_equal(block.states, want[1])
        else:
            assert block.states.dtype == np.uint16
            assert np.array_equal(block.embeddings, bits[step, 0])
            assert np.array_equal(block.states, bits[step, 1])
    ends = [m for m in got if isinstance(m, PortEnd)]
    assert [(e.request_id, e.seq, e.finish_reason) for e in ends] == \
        [(f"r{r}", STEPS, "max_length") for r in range(ROWS)]


@pytest.mark.parametrize("shm", [False, True], ids=["grpc-bytes", "shared-memory"])
def test_a_lagging_reader_gets_several_steps_per_message(server: PublisherServer,
                                                          shm: bool) -> None:
    """Raw stub: the reader takes nothing until every step is published, so the backlog is
    there to coalesce; each step still comes exactly once, in order."""
    stub = stage_pb2_grpc.StageStub(grpc.insecure_channel(server.target))
    call = stub.Subscribe(pb.SubscribeRequest(
        port="hidden", all_requests=True,
        transport=pb.TRANSPORT_SHARED_MEMORY if shm else pb.TRANSPORT_GRPC_BYTES), timeout=30)
    assert next(call).WhichOneof("payload") == "subscribed"
    server.publish_all(bf16_steps())
    server._run(server.publisher.close())
    kinds, steps = [], []
    for ev in call:
        kind = ev.WhichOneof("payload")
        kinds.append(kind)
        if kind == "batch":
            steps.append(ev.batch)
        elif kind == "steps":
            steps.extend(ev.steps.steps)
    assert "steps" in kinds and len(kinds) < STEPS
    rows = [b for b in steps if b.decode_rows.request_ids]
    assert [list(b.decode_rows.seqs) for b in rows] == [[s] * ROWS for s in range(STEPS)]
    assert [e.seq for b in steps for e in b.events] == [STEPS] * ROWS


def test_coalescing_stops_at_the_byte_cap_and_at_other_messages() -> None:
    def batch(n_bytes: int, tag: int) -> BatchMessage:
        data = TensorBytes("float32", (1, n_bytes // 8), bytes(n_bytes // 2))
        return BatchMessage((), BlockMessage((f"r{tag}",), (tag,), (0,), (0,), data, data))

    async def go() -> list:
        sub = Subscriber(None, "block", 1000)
        small = [batch(1024, i) for i in range(MAX_STEPS_PER_MESSAGE + 3)]
        big = [batch(200 << 10, 100), batch(200 << 10, 101)]
        for item in [*small, *big]:
            await sub.put(item)
        await sub.close()
        out = []
        while (msg := await sub.get()) is not None:
            out.append(msg)
        return out

    out = asyncio.run(go())
    assert [type(m) for m in out] == [StepsMessage, StepsMessage, BatchMessage]
    assert len(out[0].steps) == MAX_STEPS_PER_MESSAGE  # the step cap
    tags = [s.block.seqs[0] for m in out[:2] for s in m.steps] + [out[2].block.seqs[0]]
    assert tags == [*range(MAX_STEPS_PER_MESSAGE + 3), 100, 101]
    assert len(out[1].steps) == 4  # 3 small + the first big; the second would pass the cap

"""Member windows on a shared Step stream, as the orchestrator keeps them: a join grants its
window in the same message, the stream credit of each event goes back at once, a member's
credits go back only as its reader takes its updates (once the caller asks for the next
event), a stage that ignores member windows is held through the stream credits the slow
member keeps, whatever waits while a write is under way leaves as one message, and a relay
whose loop falls behind gathers updates into fewer deltas (with one log-probability per token
when the request asked for them)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.orchestrator.codec import Delta, FinalReport
from services.orchestrator.cohorts import MEMBER_WINDOW, WINDOW, CohortStream
from services.orchestrator.routes import Route
from services.orchestrator.run import PACING_LAG_S, Placement, RequestRun
from services.orchestrator.updates import UpdateBuffer

RUNNING, ENDED = pb.MEMBER_STATUS_RUNNING, pb.MEMBER_STATUS_ENDED


class FakeStep:
    """A Step call: records what the client sends, streams the events a test feeds it."""

    def __init__(self) -> None:
        self.sent: list[pb.StepRequest] = []
        self.events: asyncio.Queue[pb.StepEvent | None] = asyncio.Queue()
        self.writable = asyncio.Event()  # cleared: a write is under way and does not end
        self.writable.set()

    def __call__(self, requests: Any) -> FakeStep:
        async def pump() -> None:
            async for msg in requests:
                self.sent.append(msg)
                await self.writable.wait()
        self._pump = asyncio.get_running_loop().create_task(pump())
        return self

    def __aiter__(self) -> FakeStep:
        return self

    async def __anext__(self) -> pb.StepEvent:
        ev = await self.events.get()
        if ev is None:
            raise StopAsyncIteration
        return ev

    async def settle(self) -> list[pb.StepRequest]:
        """What was sent since the last call, once every message in flight has gone out."""
        for _ in range(20):
            await asyncio.sleep(0)
        sent, self.sent = self.sent, []
        return sent


def _token_event(step: int, *slots: int, status: int = RUNNING) -> pb.StepEvent:
    return pb.StepEvent(step=step, members=[
        pb.MemberUpdate(slot_id=s, status=status, token_ids=[step], text="x") for s in slots])


def _open() -> tuple[CohortStream, FakeStep, UpdateBuffer, UpdateBuffer]:
    step = FakeStep()
    stub: Any = type("Stub", (), {"Step": step})()
    stream = CohortStream("llm", "host:1", stub, lambda s, e: None)
    slow, fast = UpdateBuffer(), UpdateBuffer()
    stream.join(1, slow)
    stream.join(2, fast)
    return stream, step, slow, fast


def _window(msg: pb.StepRequest) -> dict[int, int]:
    return {c.slot_id: c.credits for c in msg.member_credits}


def _windows(sent: list[pb.StepRequest]) -> dict[int, int]:
    """Member credits of several messages, added up by slot."""
    out: dict[int, int] = {}
    for msg in sent:
        for c in msg.member_credits:
            out[c.slot_id] = out.get(c.slot_id, 0) + c.credits
    return out


def test_windows_are_granted_with_the_join_and_returned_per_read() -> None:
    async def scenario() -> None:
        stream, step, slow, fast = _open()
        joins = await step.settle()
        assert [sid for m in joins for sid in m.join] == [1, 2]
        assert joins[0].join[0] == 1 and joins[0].credits == WINDOW
        assert sum(m.credits for m in joins) == WINDOW
        for m in joins:  # each join's window travels with it
            assert set(_window(m)) == set(m.join)
        assert _windows(joins) == {1: MEMBER_WINDOW, 2: MEMBER_WINDOW}
        for i in range(5):
            step.events.put_nowait(_token_event(i, 1, 2))
        sent = await step.settle()
        assert sum(m.credits for m in sent) == 5 and not any(m.member_credits for m in sent)
        assert len(slow) == 5 and slow.num_waiting("llm") == 5
        for _ in range(5):
            fast.take()
        stream.grant(2, fast.take_consumed()["llm"])
        sent = await step.settle()
        assert len(sent) == 1 and _window(sent[0]) == {2: 5} and sent[0].credits == 0
        # the ending needs no credit and gives none back; the member leaves the stream
        step.events.put_nowait(_token_event(5, 2, status=ENDED))
        assert [m.credits for m in await step.settle()] == [1]
        assert stream.num_members == 1
        await stream.close()

    asyncio.run(scenario())


def test_a_stage_that_ignores_member_windows_is_held_by_the_slow_member() -> None:
    async def scenario() -> None:
        stream, step, slow, fast = _open()
        await step.settle()
        over = 4
        for i in range(MEMBER_WINDOW + over):
            step.events.put_nowait(_token_event(i, 1))
        sent = await step.settle()
        assert sum(m.credits for m in sent) == MEMBER_WINDOW  # the rest are kept
        assert not any(m.member_credits for m in sent)
        while len(slow):
            slow.take()
        stream.grant(1, slow.take_consumed()["llm"])
        (msg,) = await step.settle()
        assert msg.credits == over and _window(msg) == {1: MEMBER_WINDOW}
        # a member that leaves gives back what it kept
        for i in range(MEMBER_WINDOW + 2):
            step.events.put_nowait(_token_event(i, 1))
        assert sum(m.credits for m in await step.settle()) == MEMBER_WINDOW
        stream.leave(1)
        assert [m.credits for m in await step.settle()] == [2]
        await stream.close()

    asyncio.run(scenario())


def test_what_waits_behind_a_write_leaves_as_one_message() -> None:
    async def scenario() -> None:
        stream, step, slow, fast = _open()
        await step.settle()
        step.writable.clear()  # the next write stays under way
        step.events.put_nowait(_token_event(0, 1, 2))
        (first,) = await step.settle()
        assert first.credits == 1
        for i in range(1, 9):  # eight events and both readers' credits meanwhile
            step.events.put_nowait(_token_event(i, 1, 2))
        await step.settle()
        for buffer, sid in ((slow, 1), (fast, 2)):
            while len(buffer):
                buffer.take()
            stream.grant(sid, buffer.take_consumed()["llm"])
        assert await step.settle() == []  # nothing leaves while the write is under way
        step.writable.set()
        (merged,) = await step.settle()
        assert merged.credits == 8 and _window(merged) == {1: 9, 2: 9}
        assert not merged.join
        await stream.close()

    asyncio.run(scenario())


class FakeReplica:
    """A stage replica whose control calls all succeed and whose cohort records grants."""

    endpoint = "host:1"

    def __init__(self) -> None:
        self.grants: list[int] = []
        self.sink: UpdateBuffer | None = None
        self.requests: list[Any] = []  # every control call's request, in order
        replies = {"Admit": pb.AdmitResponse(admitted=True), "Prepare": pb.PrepareResponse(),
                   "Finish": pb.FinishResponse(finish_reason=pb.FINISH_REASON_MAX_LENGTH,
                                               output_token_ids=[1, 2, 3, 4, 5]),
                   "Diagnostics": pb.DiagnosticsResponse(), "Reset": pb.ResetResponse()}

        def rpc(reply: Any) -> Any:
            async def call(request: Any, **_: Any) -> Any:
                self.requests.append(request)
                return reply
            return call
        self.stub = type("Stub", (), {name: staticmethod(rpc(r)) for name, r in replies.items()})

    def cohort(self, fingerprint: str) -> FakeReplica:
        return self

    def join(self, slot_id: int, sink: UpdateBuffer) -> None:
        self.sink = sink

    def grant(self, slot_id: int, consumed: int) -> None:
        self.grants.append(consumed)


async def _joined_run(replica: FakeReplica, request: pb.GenerationRequest | None = None
                      ) -> tuple[Any, asyncio.Future[Any]]:
    """A request's events over `replica` (slot 7), its first event asked for and the request
    joined (Admit and Prepare run on fake calls)."""
    run = RequestRun("r", request or pb.GenerationRequest(text="Hi"),
                     Route(("llm",), ("llm:text",)), [Placement("llm", replica, 7)], None)
    events = run.events()
    first = asyncio.ensure_future(anext(events))
    while replica.sink is None:
        await asyncio.sleep(0)
    return events, first


def test_a_read_hands_back_its_credits_when_the_caller_asks_for_more() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        events, first = await _joined_run(replica)
        assert replica.sink is not None
        for i in range(3):
            replica.sink.put(("llm", pb.MemberUpdate(slot_id=7, status=RUNNING,
                                                     token_ids=[i], text="x")))
        delta = await first
        assert isinstance(delta, Delta) and delta.token_ids == [0, 1, 2]
        assert replica.grants == []  # the caller has not asked for more yet
        replica.sink.put(("llm", pb.MemberUpdate(slot_id=7, status=RUNNING, token_ids=[3])))
        delta = await anext(events)
        assert replica.grants == [3] and isinstance(delta, Delta) and delta.token_ids == [3]
        replica.sink.put(("llm", pb.MemberUpdate(slot_id=7, status=ENDED, token_ids=[4])))
        last = await anext(events)
        assert replica.grants == [3, 1] and isinstance(last, Delta) and last.token_ids == [4]
        final = await anext(events)
        assert replica.grants == [3, 1]  # the ending spent no credit and returns none
        assert isinstance(final, FinalReport) and final.usage.completion_tokens == 5

    asyncio.run(scenario())


def test_a_relay_that_falls_behind_gathers_updates_into_fewer_deltas() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        events, first = await _joined_run(replica)
        sink = replica.sink
        assert sink is not None

        def put(i: int) -> None:
            sink.put(("llm", pb.MemberUpdate(slot_id=7, status=RUNNING, token_ids=[i])))
        put(0)
        assert (await first).token_ids == [0]
        # an update taken as soon as it came: a delta of its own
        nxt = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0)
        put(1)
        assert (await nxt).token_ids == [1]
        # an update that waited while the loop was busy: the run waits as long again and
        # sends what came meanwhile with it
        put(2)
        time.sleep(4 * PACING_LAG_S)  # the loop is held: the update waits
        nxt = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not nxt.done()
        put(3)
        put(4)
        assert (await nxt).token_ids == [2, 3, 4]

    asyncio.run(scenario())


def test_a_slow_reader_gets_one_logprob_per_token_of_each_gathered_delta() -> None:
    def scored(i: int, status: int = RUNNING, prompt: bool = False) -> pb.MemberUpdate:
        lp = pb.TokenLogprob(token_id=i, logprob=-float(i))
        return pb.MemberUpdate(slot_id=7, status=status, token_ids=[i], text="x", logprobs=[lp],
                               prompt_logprobs=[pb.TokenLogprob(token_id=99)] if prompt else [])

    async def scenario() -> None:
        replica = FakeReplica()
        events, first = await _joined_run(replica, pb.GenerationRequest(
            text="Hi", logprobs=0, prompt_logprobs=0))
        sink = replica.sink
        assert sink is not None
        sink.put(("llm", scored(0, prompt=True)))
        for i in range(1, 4):
            sink.put(("llm", scored(i)))
        delta = await first
        assert delta.token_ids == [0, 1, 2, 3]
        assert [lp.token_id for lp in delta.logprobs] == delta.token_ids
        assert [lp.token_id for lp in delta.prompt_logprobs] == [99]
        sink.put(("llm", scored(4)))
        sink.put(("llm", scored(5, ENDED)))
        later, last = await anext(events), await anext(events)
        assert [lp.token_id for lp in later.logprobs] == later.token_ids == [4]
        assert [lp.token_id for lp in last.logprobs] == last.token_ids == [5]
        assert not later.prompt_logprobs and not last.prompt_logprobs
        wire = [d.to_pb().delta for d in (delta, later, last)]
        assert [len(w.logprobs) for w in wire] == [len(w.token_ids) for w in wire] == [4, 1, 1]
        assert isinstance(await anext(events), FinalReport)

    asyncio.run(scenario())


def test_a_request_that_asked_no_logprobs_relays_none() -> None:
    async def scenario() -> None:
        replica = FakeReplica()
        events, first = await _joined_run(replica)
        assert replica.sink is not None
        stray = pb.TokenLogprob(token_id=1)  # a stage's, unasked: not the caller's business
        replica.sink.put(("llm", pb.MemberUpdate(slot_id=7, status=RUNNING, token_ids=[1],
                                                 logprobs=[stray])))
        delta = await first
        assert delta.token_ids == [1] and not delta.logprobs and not delta.prompt_logprobs

    asyncio.run(scenario())


def test_the_stages_get_the_callers_request_unchanged() -> None:
    request = pb.GenerationRequest(
        text="Hi", logprobs=2, prompt_logprobs=1,
        sampling=pb.SamplingOverrides(presence_penalty=0.5, frequency_penalty=0.25,
                                      repetition_penalty=1.5, min_p=0.1),
        structured_output=pb.StructuredOutput(choice=pb.ChoiceList(choices=["yes", "no"])))

    async def scenario() -> None:
        replica = FakeReplica()
        await _joined_run(replica, request)
        admit = next(r for r in replica.requests if isinstance(r, pb.AdmitRequest))
        sent = pb.GenerationRequest()
        sent.CopyFrom(admit.request)
        assert sent.request_id == "r" and list(sent.ports) == []  # what the route sets
        sent.ClearField("request_id")
        assert sent == request

    asyncio.run(scenario())

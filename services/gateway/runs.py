"""A request's generations: one Generate call per choice (n per prompt; choice j of a prompt
runs with seed + j when a seed is given), run whole as many at once as the orchestrator runs
(`run_all`), or streamed and interleaved (`Merged`). On a stage with prefix reuse the n calls
of one prompt share its cached pages; the gateway does nothing for that.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from services.errors import Internal, InvalidArgument
from services.gateway.answers import Generation, Prompt
from services.gateway.call import Call
from services.gateway.errors import BadField
from services.gateway.upstream import Outcome, Piece, Upstream

_ENDED = {"error", "cancelled"}


@dataclasses.dataclass(frozen=True)
class Job:
    """One choice's generation: choice `index` of the answer, its Call and request id."""

    index: int
    call: Call
    request_id: str


def jobs_of(calls: Sequence[Call], request_id: str) -> list[Job]:
    """Choice i*n + j is prompt i's j-th; a lone choice keeps the request's id."""
    jobs = [(call.for_choice(j)) for call in calls for j in range(call.n)]
    if len(jobs) == 1:
        return [Job(0, jobs[0], request_id)]
    return [Job(k, call, f"{request_id}-{k}") for k, call in enumerate(jobs)]


async def prompt_of(upstream: Upstream, call: Call) -> Prompt:
    """What an echo of `call`'s prompt shows: its text (token ids decoded) and, with
    log-probabilities, its first token's id (the stage's tokenization of a text prompt)."""
    if not call.echo:
        return Prompt()
    if call.token_ids is not None:
        return Prompt(await upstream.detokenize(call.model, list(call.token_ids)),
                      call.token_ids[0] if call.logprobs is not None else None)
    text = call.text or ""
    if call.logprobs is None:
        return Prompt(text)
    ids = (await upstream.tokenize(call.model, call, add_special_tokens=True)).token_ids
    return Prompt(text, ids[0] if ids else None)


async def events_of(upstream: Upstream, job: Job, timeout_s: float | None
                    ) -> AsyncGenerator[Piece | Outcome, None]:
    """The job's Generate stream. A prompt-only echo's generated token is dropped here (its
    text and log-probabilities; the piece keeps the prompt's); a stage's refusal of the
    constraint is a 400 naming the field that asked for it."""
    call = job.call
    events = upstream.generate(call, job.request_id, timeout_s)
    try:
        async for ev in events:
            if call.is_prompt_only:
                ev = _prompt_only(ev)
            yield ev
    except InvalidArgument as exc:
        if call.constraint is not None and "REFUSAL_STRUCTURED_OUTPUT" in exc.message:
            raise BadField(call.constraint.source, exc.message) from None
        raise
    finally:
        await events.aclose()


def _prompt_only(ev: Piece | Outcome) -> Piece | Outcome:
    if isinstance(ev, Piece):
        return Piece("", 0, prompt_logprobs=ev.prompt_logprobs)
    if ev.finish_reason in _ENDED:
        return ev
    return dataclasses.replace(ev, finish_reason="max_length", completion_tokens=0)


async def read(events: AsyncIterator[Piece | Outcome]) -> Generation:
    """A whole Generate stream."""
    gen = Generation()
    parts: list[str] = []
    async for ev in events:
        if isinstance(ev, Piece):
            parts.append(ev.text)
            gen.logprobs.extend(ev.logprobs)
            gen.prompt_logprobs = gen.prompt_logprobs or ev.prompt_logprobs
        else:
            gen.outcome = ev
    if gen.outcome is None:
        raise Internal("the Generate stream ended without a final report")
    gen.text = "".join(parts)
    return gen


async def run_all(upstream: Upstream, jobs: Sequence[Job], timeout_s: float | None
                  ) -> list[Generation]:
    """Every job whole, as many at once as the orchestrator runs (its maxRunning: more would
    only wait in its queue, and more than its queue holds would be refused). The first to
    raise fails the request and cancels the others."""
    in_flight = asyncio.Semaphore(upstream.max_running)

    async def one(job: Job) -> Generation:
        async with in_flight:
            events = events_of(upstream, job, timeout_s)
            try:
                return await read(events)
            finally:
                await events.aclose()

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(job)) for job in jobs]
    except ExceptionGroup as failures:  # the first one's error answers (its HTTP status)
        raise failures.exceptions[0] from None
    return [task.result() for task in tasks]


class Merged:
    """Several jobs' streams as one of (choice index, event), in the order they come; an
    error a stream raised comes as its event (a ServiceError, or a bug). `close()` cancels
    what still runs."""

    def __init__(self, upstream: Upstream, jobs: Sequence[Job], timeout_s: float | None
                 ) -> None:
        # bounded: a slow reader holds the streams back instead of growing memory
        self._queue: asyncio.Queue[tuple[int, Piece | Outcome | Exception]] = \
            asyncio.Queue(maxsize=4 * len(jobs))
        self._streams = [events_of(upstream, job, timeout_s) for job in jobs]
        # one stream is read where it is asked for: no task and no queue on its per-token path
        self._tasks = [] if len(jobs) == 1 else [
            asyncio.get_running_loop().create_task(self._pump(job.index, events))
            for job, events in zip(jobs, self._streams, strict=True)]

    async def _pump(self, index: int, events: AsyncIterator[Piece | Outcome]) -> None:
        try:
            async for ev in events:
                await self._queue.put((index, ev))
                if isinstance(ev, Outcome):
                    return
            await self._queue.put((index, Internal("the Generate stream ended without a "
                                                   "final report")))
        except Exception as exc:  # a ServiceError, or a bug (500)
            await self._queue.put((index, exc))

    async def next(self) -> tuple[int, Piece | Outcome | Exception]:
        if self._tasks:
            return await self._queue.get()
        try:
            return 0, await anext(self._streams[0])
        except StopAsyncIteration:
            return 0, Internal("the Generate stream ended without a final report")
        except Exception as exc:  # a ServiceError, or a bug (500)
            return 0, exc

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for events in self._streams:
            await events.aclose()

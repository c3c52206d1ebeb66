"""The hidden port's prefill window when the prompt is prefilled over several steps: the
stage holds the prompt's pieces and publishes them as one window, in the same messages (bytes,
sequence numbers, chunks, CRC) as a prompt prefilled in one step; what it holds is freed when
the request ends."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest

from llm_runner_svc.engines.batch import HiddenStates
from llm_runner_svc.runtime import FinishReason, StepEvent
from llm_runner_svc.stage.hidden_messages import EndMessage, HiddenMessage, WireArray
from llm_runner_svc.stage.publish import HiddenPublisher
from llm_runner_svc.stage.publish_step import PromptWindows, publish_step
from llm_runner_svc.stage.request import StageRequest
from llm_runner_svc.stage.shm_budget import ShmBudget, max_payload_bytes
from services.stage.slot import Slot

WIDTH, PROMPT_LEN, NUM_DECODES = 64, 20, 3
ROW_BYTES = 2 * WIDTH * 4  # embeddings + states of one float32 position


@dataclass
class Run:
    """What the subscribers got and what the slot recorded."""

    one: list  # a subscriber to the request
    every: list  # a subscriber to every request
    crc32: int
    num_windows: int
    held_bytes_seen: list[int]


def states(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((n, WIDTH), dtype=np.float32),
            rng.standard_normal((n, WIDTH), dtype=np.float32))


def steps_for(cuts: list[int], reason: FinishReason = FinishReason.MAX_LENGTH
              ) -> list[StepEvent]:
    """The runtime's events of one request: the prompt's states in the pieces `cuts` marks
    (the last piece with the first token), then NUM_DECODES decode rows, the last one with
    the end. The states are the same whatever the cuts."""
    rng = np.random.default_rng(5)
    emb, st = states(rng, PROMPT_LEN + NUM_DECODES)
    bounds = [0, *cuts, PROMPT_LEN]
    events = [StepEvent("slot-1", hidden=[HiddenStates(emb[lo:hi], st[lo:hi], lo)])
              for lo, hi in zip(bounds, bounds[1:], strict=False)]
    events[-1].token_ids.append(100)
    for i in range(NUM_DECODES):
        p = PROMPT_LEN + i
        ev = StepEvent("slot-1", [101 + i], hidden=[HiddenStates(emb[p:p + 1], st[p:p + 1], p)])
        events.append(ev)
    events[-1].finish_reason = reason
    return events


async def publish(events: list[StepEvent], max_message_bytes: int = 16 << 20) -> Run:
    """Publish `events` as the stage does after each step; drain both subscribers."""
    pub = HiddenPublisher("block", 1000, max_message_bytes, ShmBudget(4096, 2, 1 << 20))
    one, every = await pub.subscribe("r", False), await pub.subscribe(None, False)
    prompt = tuple(range(3, 3 + PROMPT_LEN))
    slot = Slot(1, StageRequest("r", token_ids=prompt, ports=("hidden",)), admitted=prompt)
    prompts = PromptWindows()
    held = []
    for ev in events:
        slot.run.output_ids.extend(ev.token_ids)  # as the step loop records them first
        pub.begin_step()
        await publish_step(pub, prompts, [(slot, ev)])
        await pub.flush_step()
        held.append(prompts.num_bytes)
    await pub.close()
    got: tuple[list, list] = ([], [])
    for sub, out in ((one, got[0]), (every, got[1])):
        while (msg := await sub.get()) is not None:
            out.append(msg)
    return Run(got[0], got[1], slot.telemetry.hidden_crc32, slot.telemetry.num_hidden_windows,
               held)


@pytest.mark.parametrize("max_message_bytes", [16 << 20, 4096],
                         ids=["one-message", "chunked"])  # 4096: 8 positions a message
@pytest.mark.parametrize("cuts", [[4], [4, 7, 16], list(range(1, PROMPT_LEN))])
def test_a_prompt_prefilled_in_pieces_publishes_the_one_step_window(
        cuts: list[int], max_message_bytes: int) -> None:
    whole = asyncio.run(publish(steps_for([]), max_message_bytes))
    split = asyncio.run(publish(steps_for(cuts), max_message_bytes))
    assert split.one == whole.one and split.every == whole.every  # bytes, seqs, chunks
    assert (split.crc32, split.num_windows) == (whole.crc32, whole.num_windows)
    prefill = [m for m in split.one if isinstance(m, HiddenMessage) and m.is_prefill]
    per_message = max_payload_bytes(max_message_bytes) // ROW_BYTES
    assert [m.start_position for m in prefill] == list(range(0, PROMPT_LEN, per_message))
    assert sum(len(m.token_ids) for m in prefill) == PROMPT_LEN
    assert [m.seq for m in split.one] == list(range(len(split.one)))
    # held while the prompt is in pieces, nothing once it is published
    assert split.held_bytes_seen[:len(cuts)] == [c * ROW_BYTES for c in cuts]
    assert split.held_bytes_seen[len(cuts):] == [0] * (NUM_DECODES + 1)


def test_a_request_ending_mid_prompt_frees_its_pieces_and_publishes_only_its_end() -> None:
    events = steps_for([4, 9])[:2]  # two pieces of the prompt, then the request is cancelled
    events.append(StepEvent("slot-1", finish_reason=FinishReason.CANCELLED))
    run = asyncio.run(publish(events))
    assert run.held_bytes_seen == [4 * ROW_BYTES, 9 * ROW_BYTES, 0]
    assert run.one == [EndMessage("r", 0, "cancelled", "")]
    assert (run.crc32, run.num_windows) == (0, 0)


def test_retain_drops_the_pieces_of_requests_no_longer_live() -> None:
    prompts = PromptWindows()
    emb, st = states(np.random.default_rng(1), 4)
    for rid in ("a", "b"):
        assert prompts.take(rid, [HiddenStates(emb, st, 0)], PROMPT_LEN) == []
    assert prompts.num_requests == 2 and prompts.num_bytes == 2 * 4 * ROW_BYTES
    prompts.retain(["b", "c"])
    assert prompts.num_requests == 1 and prompts.num_bytes == 4 * ROW_BYTES
    prompts.clear()
    assert prompts.num_requests == 0 and prompts.num_bytes == 0


def test_bfloat16_pieces_are_joined_bit_for_bit() -> None:
    bits = np.random.default_rng(2).integers(0, 1 << 16, (PROMPT_LEN, WIDTH), dtype=np.uint16)
    prompts = PromptWindows()
    pieces = [HiddenStates(WireArray(bits[lo:hi], "bfloat16"), WireArray(bits[lo:hi],
                                                                        "bfloat16"), lo)
              for lo, hi in ((0, 7), (7, 8), (8, PROMPT_LEN))]
    assert prompts.take("r", pieces[:2], PROMPT_LEN) == []
    assert prompts.num_bytes == 2 * 8 * WIDTH * 2
    (window,) = prompts.take("r", pieces[2:], PROMPT_LEN)
    assert window.start_position == 0 and window.states.dtype.name == "bfloat16"
    assert window.states.tobytes() == bits.tobytes()
    assert prompts.num_requests == 0

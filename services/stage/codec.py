"""Protobuf <-> kit types of the Stage contract (finish reasons, slot states, Step events)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import struct_pb2

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.errors import InvalidArgument
from services.stage.cohort import CohortEvent
from services.stage.ending import FinishReason
from services.stage.stepper import TokenScore

_REASON_TO_PB: dict[FinishReason, pb.FinishReason] = {
    FinishReason.END_OF_SEQUENCE: pb.FINISH_REASON_END_OF_SEQUENCE,
    FinishReason.MAX_LENGTH: pb.FINISH_REASON_MAX_LENGTH,
    FinishReason.STOP_WORDS: pb.FINISH_REASON_STOP_WORDS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_REASON_FROM_PB: dict[int, FinishReason] = {int(v): k for k, v in _REASON_TO_PB.items()}
_STATE_TO_PB: dict[str, pb.SlotState] = {
    "ADMITTED": pb.SLOT_STATE_ADMITTED, "PREPARED": pb.SLOT_STATE_PREPARED,
    "RUNNING": pb.SLOT_STATE_RUNNING, "FINISHED": pb.SLOT_STATE_FINISHED}


def reason_to_pb(reason: FinishReason | None) -> pb.FinishReason:
    return pb.FINISH_REASON_UNSPECIFIED if reason is None else _REASON_TO_PB[reason]


def reason_from_pb(value: int) -> FinishReason | None:
    """FinishReason of a request field; UNSPECIFIED is None, an unknown number is malformed."""
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    if value not in _REASON_FROM_PB:
        raise InvalidArgument(f"reason {value} is not a FinishReason value")
    return _REASON_FROM_PB[value]


def state_to_pb(wire_state: str) -> pb.SlotState:
    return _STATE_TO_PB[wire_state]


def member_credits_from_pb(msg: pb.StepRequest) -> dict[int, int]:
    """StepRequest.member_credits as slot id -> credits (a slot named twice adds up)."""
    out: dict[int, int] = {}
    for mc in msg.member_credits:
        if mc.slot_id < 0:
            raise InvalidArgument("member_credits names a negative slot id")
        out[mc.slot_id] = out.get(mc.slot_id, 0) + mc.credits
    return out


def event_to_pb(ev: CohortEvent) -> pb.StepEvent:
    # Built in place, a running member's end fields left at their defaults: this runs for
    # every member of every step (64 members: about 40 against 70 us when each member was a
    # keyword message with every field).
    out = pb.StepEvent(step=ev.step)
    add = out.members.add
    for m in ev.members:
        member = add(slot_id=m.slot_id, status=pb.MEMBER_STATUS_RUNNING, token_ids=m.token_ids,
                     text=m.text)
        if m.is_ended:
            member.status = pb.MEMBER_STATUS_ENDED
            member.finish_reason = reason_to_pb(m.finish_reason)
            member.error = m.error or ""
    if ev.has_scores:  # no member asked for log-probabilities otherwise: nothing to look at
        for m, member in zip(ev.members, out.members, strict=True):
            if m.logprobs:
                logprobs_to_pb(member.logprobs, m.logprobs)
            if m.prompt_logprobs:
                logprobs_to_pb(member.prompt_logprobs, m.prompt_logprobs)
    for r in ev.refused:
        out.refused.add(slot_id=r.slot_id, code=r.code, message=r.message)
    return out


def logprobs_to_pb(out: Any, scores: Sequence[TokenScore]) -> None:
    """Append `scores` to `out`, a repeated TokenLogprob field."""
    add = out.add
    for sc in scores:
        top = sc.top
        add(token_id=sc.token_id, logprob=sc.logprob, top_ids=[t for t, _ in top],
            top_logprobs=[lp for _, lp in top])


def struct_from(values: dict[str, Any]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(values)
    return out

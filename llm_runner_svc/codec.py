"""Protobuf <-> domain translation for the Stage service. The only module besides the
servicer that touches `*_pb2` objects."""

from __future__ import annotations

from typing import Any

from google.protobuf import struct_pb2

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.runtime import FinishReason, RequestMetrics
from llm_runner_svc.stage import ChatTurn, SlotState, StageRequest
from llm_runner_svc.stage.admission import Admission, Refusal
from llm_runner_svc.stage.describe import StageDescription
from llm_runner_svc.stage.hidden_messages import (
    BatchMessage,
    EndMessage,
    PortMessage,
    RegionMessage,
    StepsMessage,
    TensorBytes,
)
from llm_runner_svc.stage.slots import Slot
from llm_runner_svc.stage.stepping import CohortEvent
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import tensor_pb2

_REASON_TO_PB: dict[FinishReason, pb.FinishReason] = {
    FinishReason.END_OF_SEQUENCE: pb.FINISH_REASON_END_OF_SEQUENCE,
    FinishReason.MAX_LENGTH: pb.FINISH_REASON_MAX_LENGTH,
    FinishReason.STOP_WORDS: pb.FINISH_REASON_STOP_WORDS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_REASON_FROM_PB: dict[int, FinishReason] = {int(v): k for k, v in _REASON_TO_PB.items()}
_STATE_TO_PB: dict[SlotState, pb.SlotState] = {SlotState.ADMITTED: pb.SLOT_STATE_ADMITTED,
                SlotState.PREPARED: pb.SLOT_STATE_PREPARED,
                SlotState.RUNNING: pb.SLOT_STATE_RUNNING,
                SlotState.FINISHED: pb.SLOT_STATE_FINISHED}
_REFUSAL_TO_PB: dict[Refusal, pb.Refusal] = {
    r: pb.Refusal.Value("REFUSAL_" + r.name) for r in Refusal}
_DTYPE_TO_PB = {None: tensor_pb2.DTYPE_UNSPECIFIED, "float32": tensor_pb2.DTYPE_FLOAT32,
                "float16": tensor_pb2.DTYPE_FLOAT16, "bfloat16": tensor_pb2.DTYPE_BFLOAT16,
                "int32": tensor_pb2.DTYPE_INT32, "int64": tensor_pb2.DTYPE_INT64,
                "uint8": tensor_pb2.DTYPE_UINT8}


def reason_to_pb(reason: FinishReason | None) -> pb.FinishReason:
    return pb.FINISH_REASON_UNSPECIFIED if reason is None else _REASON_TO_PB[reason]


def reason_from_pb(value: int) -> FinishReason | None:
    """FinishReason of a request field; UNSPECIFIED is None, an unknown number is malformed."""
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    if value not in _REASON_FROM_PB:
        raise InvalidArgument(f"reason {value} is not a FinishReason value")
    return _REASON_FROM_PB[value]


def request_from_pb(slot_id: int, req_pb: pb.GenerationRequest) -> StageRequest:
    kind = req_pb.WhichOneof("prompt")
    s = req_pb.sampling
    return StageRequest(
        request_id=req_pb.request_id or f"slot-{slot_id}",
        text=req_pb.text if kind == "text" else None,
        messages=tuple(ChatTurn(m.role, m.content) for m in req_pb.messages.messages)
        if kind == "messages" else None,
        token_ids=tuple(req_pb.token_ids.ids) if kind == "token_ids" else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(req_pb.stop), logit_bias=dict(req_pb.logit_bias), lora=req_pb.lora,
        ports=tuple(req_pb.ports), num_media=len(req_pb.media), ignore_eos=req_pb.ignore_eos)


def admission_to_pb(adm: Admission) -> pb.AdmitResponse:
    refusal = pb.REFUSAL_UNSPECIFIED if adm.refusal is None else _REFUSAL_TO_PB[adm.refusal]
    return pb.AdmitResponse(admitted=adm.is_admitted, refusal=refusal, reason=adm.reason,
                            prompt_tokens=adm.prompt_tokens)


def describe_to_pb(d: StageDescription) -> pb.DescribeResponse:
    m = d.model
    return pb.DescribeResponse(
        contract_version=d.contract_version, stage_id=d.stage_id, runner=d.runner,
        emits=[pb.PortSpec(name=p.name, dtype=_DTYPE_TO_PB[p.dtype], width=p.width)
               for p in d.emits],
        inputs=list(d.inputs), max_batch=d.max_batch, max_seq=d.max_seq,
        max_step_window=d.max_step_window, engine=d.engine,
        model=pb.ModelInfo(name=m.name, format=m.format, architecture=m.config.arch,
                           vocab_size=m.config.vocab_size, hidden_size=m.config.hidden_size,
                           num_layers=m.config.num_layers, max_position=m.config.max_position,
                           has_chat_template=m.chat_template is not None),
        sampling_defaults=pb.SamplingDefaults(
            max_generate_length=d.sampling.max_generate_length,
            temperature=d.sampling.temperature, top_p=d.sampling.top_p, top_k=d.sampling.top_k))


def prepared_to_pb(slot: Slot) -> pb.PrepareResponse:
    assert slot.runtime_request is not None
    sp = slot.runtime_request.sampling
    return pb.PrepareResponse(
        prompt_tokens=len(slot.prompt_ids), seed=slot.seed,
        sampling=pb.SamplingDefaults(max_generate_length=sp.max_new_tokens,
                                     temperature=sp.temperature, top_p=sp.top_p,
                                     top_k=sp.top_k))


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
    for r in ev.refused:
        out.refused.add(slot_id=r.slot_id, code=r.code, message=r.message)
    return out


def _metrics_to_pb(m: RequestMetrics | None, slot: Slot) -> pb.RequestMetrics:
    if m is None:
        return pb.RequestMetrics(prompt_tokens=len(slot.prompt_ids))
    return pb.RequestMetrics(
        prompt_tokens=m.prompt_tokens, generated_tokens=m.generated_tokens, queue_ms=m.queue_ms,
        prefill_ms=m.prefill_ms, decode_ms=m.decode_ms, ttft_ms=m.ttft_ms,
        tokens_per_s=m.tokens_per_s)


def finished_to_pb(slot: Slot) -> pb.FinishResponse:
    return pb.FinishResponse(
        slot_id=slot.slot_id, finish_reason=reason_to_pb(slot.ended), error=slot.error or "",
        output_token_ids=slot.output_ids, output_text="".join(slot.output_text),
        metrics=_metrics_to_pb(slot.metrics, slot))


def state_to_pb(state: SlotState) -> pb.SlotState:
    return _STATE_TO_PB[state]


def struct_from(values: dict[str, Any]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(values)
    return out


def _tensor_to_pb(t: TensorBytes) -> tuple[tensor_pb2.Tensor, pb.ShmSlice | None]:
    tensor = tensor_pb2.Tensor(dtype=_DTYPE_TO_PB[t.dtype], shape=list(t.shape),
                               data=t.data or b"")
    return tensor, None if t.data is not None else pb.ShmSlice(offset=t.offset, length=t.length)


def port_message_to_pb(msg: PortMessage) -> pb.SubscribeEvent:
    if isinstance(msg, StepsMessage):
        return pb.SubscribeEvent(steps=pb.StepBatches(
            steps=[port_message_to_pb(step).batch for step in msg.steps]))
    if isinstance(msg, BatchMessage):
        batch = pb.EventBatch(events=[port_message_to_pb(m) for m in msg.messages])
        if msg.block is not None:
            b = msg.block
            emb, emb_shm = _tensor_to_pb(b.embeddings)
            st, st_shm = _tensor_to_pb(b.states)
            rows = batch.decode_rows
            rows.request_ids.extend(b.request_ids)
            rows.seqs.extend(b.seqs)
            rows.positions.extend(b.positions)
            rows.token_ids.extend(b.token_ids)
            rows.embeddings.CopyFrom(emb)
            rows.states.CopyFrom(st)
            if emb_shm is not None and st_shm is not None:
                rows.embeddings_shm.CopyFrom(emb_shm)
                rows.states_shm.CopyFrom(st_shm)
        return pb.SubscribeEvent(batch=batch)
    if isinstance(msg, RegionMessage):
        return pb.SubscribeEvent(region=pb.ShmRegion(name=msg.name, size=msg.size))
    if isinstance(msg, EndMessage):
        reason = _REASON_TO_PB[FinishReason(msg.finish_reason)]
        return pb.SubscribeEvent(request_id=msg.request_id, seq=msg.seq,
                                 end=pb.PortEnd(finish_reason=reason, error=msg.error))
    emb, emb_shm = _tensor_to_pb(msg.embeddings)
    st, st_shm = _tensor_to_pb(msg.states)
    hidden = pb.HiddenStates(start_position=msg.start_position, token_ids=msg.token_ids,
                             embeddings=emb, states=st, is_prefill=msg.is_prefill)
    if emb_shm is not None and st_shm is not None:
        hidden.embeddings_shm.CopyFrom(emb_shm)
        hidden.states_shm.CopyFrom(st_shm)
    return pb.SubscribeEvent(request_id=msg.request_id, seq=msg.seq, hidden=hidden)

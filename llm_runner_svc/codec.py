"""Protobuf <-> domain translation for the Stage service. The only module besides the
servicer that touches `*_pb2` objects."""

from __future__ import annotations

from typing import Any

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.runtime import FinishReason, RequestMetrics
from llm_runner_svc.runtime.constraint import Constraint
from llm_runner_svc.stage import ChatPart, ChatTurn, MediaItem, StageRequest
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
from llm_runner_svc.stage.limits import RequestSizes
from llm_runner_svc.stage.tokenizing import Tokenized
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import tensor_pb2
from services.stage.codec import reason_to_pb
from services.stage.slot import Slot

_REFUSAL_TO_PB: dict[Refusal, pb.Refusal] = {
    r: pb.Refusal.Value("REFUSAL_" + r.name) for r in Refusal}
_DTYPE_TO_PB = {None: tensor_pb2.DTYPE_UNSPECIFIED, "float32": tensor_pb2.DTYPE_FLOAT32,
                "float16": tensor_pb2.DTYPE_FLOAT16, "bfloat16": tensor_pb2.DTYPE_BFLOAT16,
                "int32": tensor_pb2.DTYPE_INT32, "int64": tensor_pb2.DTYPE_INT64,
                "uint8": tensor_pb2.DTYPE_UINT8}


def request_from_pb(slot_id: int, req_pb: pb.GenerationRequest) -> StageRequest:
    kind = req_pb.WhichOneof("prompt")
    s = req_pb.sampling
    return StageRequest(
        request_id=req_pb.request_id or f"slot-{slot_id}",
        text=req_pb.text if kind == "text" else None,
        messages=tuple(ChatTurn(m.role, m.content, tuple(_part(p) for p in m.parts))
                       for m in req_pb.messages.messages) if kind == "messages" else None,
        token_ids=tuple(req_pb.token_ids.ids) if kind == "token_ids" else None,
        temperature=_opt(s, "temperature"), top_k=_opt(s, "top_k"), top_p=_opt(s, "top_p"),
        max_tokens=_opt(s, "max_tokens"), seed=_opt(s, "seed"),
        stop=tuple(req_pb.stop), logit_bias=dict(req_pb.logit_bias), lora=req_pb.lora,
        ports=tuple(req_pb.ports),
        media=tuple(MediaItem(m.mime_type, m.data) for m in req_pb.media),
        ignore_eos=req_pb.ignore_eos, disable_spec_decode=req_pb.disable_spec_decode,
        cache_lookup=_policy(req_pb.context_cache_lookup_policy, pb.CacheLookupPolicy,
                             pb.CACHE_LOOKUP_POLICY_BYPASS),
        cache_generated=_policy(req_pb.context_cache_commit_policy, pb.CacheCommitPolicy,
                                pb.CACHE_COMMIT_POLICY_PREFILL_STATE_ONLY),
        presence_penalty=_opt(s, "presence_penalty"),
        frequency_penalty=_opt(s, "frequency_penalty"),
        repetition_penalty=_opt(s, "repetition_penalty"), min_p=_opt(s, "min_p"),
        logprobs=_opt(req_pb, "logprobs"), prompt_logprobs=_opt(req_pb, "prompt_logprobs"),
        constraint=constraint_from_pb(req_pb.structured_output))


def _opt(msg: Any, name: str) -> Any:
    """An optional field's value; None when unset."""
    return getattr(msg, name) if msg.HasField(name) else None


def constraint_from_pb(so_pb: pb.StructuredOutput) -> Constraint | None:
    """The structured output as a Constraint; None when no kind is set or json_object is
    false (the same as unset). Empty text or no choices: InvalidArgument."""
    kind = so_pb.WhichOneof("kind")
    if kind is None or kind == "json_object" and not so_pb.json_object:
        return None
    if kind == "json_object":
        return Constraint(kind)
    if kind == "choice":
        return Constraint(kind, tuple(so_pb.choice.choices))
    return Constraint(kind, getattr(so_pb, kind))


def _part(part_pb: pb.ChatPart) -> ChatPart:
    if part_pb.WhichOneof("part") == "image":
        return ChatPart(image=part_pb.image)
    return ChatPart(text=part_pb.text)


def _policy(value: int, enum: Any, off: int) -> bool:
    """A cache policy enum as a flag: False for `off`, True for the others (unspecified
    included); a value the enum does not define is refused."""
    if value not in enum.values():
        raise InvalidArgument(f"{enum.DESCRIPTOR.name} {value} is not defined "
                              f"(valid: {', '.join(enum.keys())})")
    return value != off


def request_sizes(req_pb: pb.GenerationRequest) -> RequestSizes:
    """The counts Admit checks before converting the request (each O(1) on the message)."""
    return RequestSizes(num_stop=len(req_pb.stop), num_logit_bias=len(req_pb.logit_bias),
                        num_messages=len(req_pb.messages.messages),
                        num_token_ids=len(req_pb.token_ids.ids), num_media=len(req_pb.media),
                        media_bytes=tuple(len(m.data) for m in req_pb.media))


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
            temperature=d.sampling.temperature, top_p=d.sampling.top_p, top_k=d.sampling.top_k),
        lora_adapters=list(d.lora_adapters), max_loras=d.max_loras)


def prepared_to_pb(slot: Slot) -> pb.PrepareResponse:
    sp = slot.prepared.request.sampling
    return pb.PrepareResponse(
        prompt_tokens=len(slot.admitted), seed=slot.prepared.seed,
        sampling=pb.SamplingDefaults(max_generate_length=sp.max_new_tokens,
                                     temperature=sp.temperature, top_p=sp.top_p,
                                     top_k=sp.top_k))


def _metrics_to_pb(m: RequestMetrics | None, slot: Slot) -> pb.RequestMetrics:
    if m is None:
        return pb.RequestMetrics(prompt_tokens=len(slot.admitted))
    return pb.RequestMetrics(
        prompt_tokens=m.prompt_tokens, generated_tokens=m.generated_tokens, queue_ms=m.queue_ms,
        prefill_ms=m.prefill_ms, decode_ms=m.decode_ms, ttft_ms=m.ttft_ms,
        tokens_per_s=m.tokens_per_s)


def finished_to_pb(slot: Slot) -> pb.FinishResponse:
    run = slot.run
    return pb.FinishResponse(
        slot_id=slot.slot_id, finish_reason=reason_to_pb(run.ended), error=run.error or "",
        output_token_ids=run.output_ids, output_text="".join(run.output_text),
        metrics=_metrics_to_pb(run.metrics, slot))


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
        reason = reason_to_pb(FinishReason(msg.finish_reason))
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


def tokenized_to_pb(t: Tokenized) -> pb.TokenizeResponse:
    return pb.TokenizeResponse(token_ids=t.token_ids, max_seq=t.max_seq,
                               vocab_size=t.vocab_size, bos_token=t.bos_token,
                               eos_token=t.eos_token, model=t.model,
                               chat_template=t.chat_template)

"""The gateway's one dependency: the orchestrator over gRPC (Generate, Topology, Tokenize,
Detokenize, health).

`Upstream` owns a few `grpc.aio` channels, each its own connection (a private subchannel
pool: channels of equal arguments would otherwise share one), and deals the HTTP requests'
calls over them round robin (HTTP/2 multiplexes each channel's). The orchestrator's workers
share one port and the kernel gives each connection to one of them, so a single channel would
load one worker only; several spread the calls (as they do over orchestrator replicas behind
a Service that balances connections). Every failed call raises the `ServiceError` of its
status (`services.errors.error_for`), so the HTTP side maps one set of typed errors; a channel
that cannot connect is `Unavailable` naming the orchestrator's address. Only this module
touches the contract's messages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.errors import DeadlineExceeded, NotFound, ServiceError, Unavailable, error_for
from services.gateway.call import Call
from services.gateway.constraints import Constraint
from services.telemetry import metadata_for

log = logging.getLogger(__name__)
_DETOKENIZE_AT_ONCE = 64  # Detokenize calls in flight for one request's token texts

_FINISH_NAMES = {
    pb.FINISH_REASON_END_OF_SEQUENCE: "end_of_sequence",
    pb.FINISH_REASON_MAX_LENGTH: "max_length",
    pb.FINISH_REASON_STOP_WORDS: "stop_words",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability where it stood, and the likeliest alternatives there
    (`top`: (token id, log-probability), likeliest first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Piece:
    """New text of the request's sink: one or more steps' tokens; with log-probabilities
    asked for, one per token (`logprobs`) and, on the first piece, the prompt's from its
    second token on (`prompt_logprobs`)."""

    text: str
    num_tokens: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Tokens:
    """A prompt's ids from the served model's tokenizer, and the tokenizer's facts."""

    token_ids: tuple[int, ...]
    max_seq: int
    vocab_size: int
    bos_token: str
    eos_token: str
    model: str  # the stage's model name (a file's, not the served name)
    chat_template: str  # its Jinja source; "" when the model has none


@dataclass(frozen=True)
class Outcome:
    """The end of a request; `finish_reason` is the contract's name ("end_of_sequence",
    "max_length", "stop_words", "cancelled", "error")."""

    finish_reason: str
    error: str
    prompt_tokens: int
    completion_tokens: int


class Upstream:
    """A connection to the orchestrator at `target` ("host:port"). Create it inside the event
    loop that uses it; `close()` ends calls still running."""

    def __init__(self, target: str, max_message_bytes: int = 16 << 20,
                 num_channels: int = 1, served_model_name: str | None = None) -> None:
        """`served_model_name`: the name the first text sink's stage is served under instead
        of its topology's servedModelName or stage id (a Hugging Face repo id, say, that
        clients load a tokenizer by)."""
        self.target = target
        self._served_name = served_model_name
        self._stage_of: dict[str, str] = {}  # model id -> the stage whose text it streams
        self._channels = [grpc.aio.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.use_local_subchannel_pool", 1)]) for _ in range(num_channels)]
        self._stubs = [orchestrator_pb2_grpc.OrchestratorStub(c) for c in self._channels]
        self._turns = itertools.cycle(self._stubs)
        self._stub = self._stubs[0]  # Topology
        self._health = health_pb2_grpc.HealthStub(self._channels[0])
        self._models: tuple[str, ...] = ()
        self._token_texts: dict[str, dict[int, str]] = {}  # stage id -> token id -> its text
        self.max_running = 1  # the orchestrator's maxRunning, as its Topology last said

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def models(self, timeout_s: float = 10.0) -> tuple[str, ...]:
        """The model ids: each stage whose text port is a sink of the topology, in the order
        of its sinks. Raises like every call (Unavailable when the orchestrator is down)."""
        try:
            answer = await self._stub.Topology(opb.TopologyRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        stages = list(dict.fromkeys(s.split(":", 1)[0] for s in answer.sinks
                                    if s.endswith(":text")))
        served = {s.id: s.served_model_name for s in answer.stages if s.served_model_name}
        names = [served.get(stage, stage) for stage in stages]
        if self._served_name is not None and names:
            names[0] = self._served_name
        stage_of = dict(zip(names, stages, strict=True))
        if stage_of != self._stage_of:
            self._token_texts.clear()  # another topology: maybe other vocabularies
        self._stage_of = stage_of
        self.max_running = max(1, answer.max_running)
        self._models = tuple(names)
        return self._models

    async def check_model(self, model: str) -> None:
        """NotFound for a model the topology does not serve (the list is fetched again on a
        miss, so it follows a restarted orchestrator)."""
        if model in self._models or model in await self.models():
            return
        raise NotFound(f"model {model!r} does not exist; this deployment serves "
                       f"{', '.join(self._models) or 'no text model'} (GET /v1/models)")

    async def is_serving(self, timeout_s: float = 2.0) -> bool:
        """Whether the orchestrator's health check answers SERVING."""
        try:
            answer = await self._health.Check(health_pb2.HealthCheckRequest(),
                                               timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    async def generate(self, call: Call, request_id: str, timeout_s: float | None
                       ) -> AsyncGenerator[Piece | Outcome, None]:
        """Streams one generation: `Piece`s, then one `Outcome`. The current trace context
        travels as the call's traceparent. Closing the iterator early (the HTTP client went
        away) cancels the call, and the orchestrator finishes the request on every stage."""
        rpc = next(self._turns).Generate(
            _request(call, request_id, self._stage_of.get(call.model, call.model)),
            timeout=timeout_s, metadata=metadata_for())
        try:
            async for event in rpc:
                if event.HasField("delta"):
                    delta = event.delta
                    yield Piece(delta.text, len(delta.token_ids), tuple(delta.token_ids),
                                _logprobs(delta.logprobs), _logprobs(delta.prompt_logprobs))
                elif event.HasField("final"):
                    final = event.final
                    yield Outcome(_FINISH_NAMES.get(final.finish_reason, "error"), final.error,
                                  final.usage.prompt_tokens, final.usage.completion_tokens)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc, timeout_s) from None
        finally:
            rpc.cancel()  # a no-op after a normal end

    async def tokenize(self, model: str, call: Call, add_special_tokens: bool,
                       timeout_s: float = 60.0) -> Tokens:
        """The ids of `call`'s prompt (text or messages) from `model`'s stage tokenizer,
        through the orchestrator; the model must have been checked (check_model)."""
        request = pb.TokenizeRequest(request=_request(call, "", "").request,
                                     add_special_tokens=add_special_tokens,
                                     stage_id=self._stage_of.get(model, model))
        try:
            answer = await next(self._turns).Tokenize(request, timeout=timeout_s,
                                                      metadata=metadata_for())
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return Tokens(tuple(answer.token_ids), answer.max_seq, answer.vocab_size,
                      answer.bos_token, answer.eos_token, answer.model, answer.chat_template)

    async def detokenize(self, model: str, token_ids: list[int], timeout_s: float = 60.0
                         ) -> str:
        """The text of `token_ids` (special tokens included) from `model`'s stage tokenizer."""
        request = pb.DetokenizeRequest(token_ids=token_ids,
                                       stage_id=self._stage_of.get(model, model))
        try:
            answer = await next(self._turns).Detokenize(request, timeout=timeout_s,
                                                        metadata=metadata_for())
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return str(answer.text)

    async def token_texts(self, model: str, token_ids: Iterable[int]) -> dict[int, str]:
        """The text of each token on its own (special tokens included), from `model`'s stage
        tokenizer: one Detokenize per id not seen before (a vocabulary does not change while
        its stage serves, so the answers are kept)."""
        known = self._token_texts.setdefault(self._stage_of.get(model, model), {})
        missing = [i for i in dict.fromkeys(token_ids) if i not in known]
        for start in range(0, len(missing), _DETOKENIZE_AT_ONCE):
            ids = missing[start:start + _DETOKENIZE_AT_ONCE]
            texts = await asyncio.gather(*(self.detokenize(model, [i]) for i in ids))
            known.update(zip(ids, texts, strict=True))
        return known

    def _error(self, exc: grpc.aio.AioRpcError, timeout_s: float | None = None
               ) -> ServiceError:
        code, details = exc.code(), exc.details() or ""
        if code is grpc.StatusCode.UNAVAILABLE and "connect" in details.lower():
            return Unavailable(f"the orchestrator at {self.target} does not answer ({details})")
        if code is grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None:
            return DeadlineExceeded(f"the request's deadline of {timeout_s:g} s passed before "
                                    f"it finished ({details})")
        return error_for(code.name, details)


def _chat_message(role: str, content: str | tuple[str | int, ...]) -> pb.ChatMessage:
    if isinstance(content, str):
        return pb.ChatMessage(role=role, content=content)
    return pb.ChatMessage(role=role, parts=[
        pb.ChatPart(image=p) if isinstance(p, int) else pb.ChatPart(text=p) for p in content])


def _logprobs(items: Iterable[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.token_id, lp.logprob,
                              tuple(zip(lp.top_ids, lp.top_logprobs, strict=True)))
                 for lp in items)


def _structured_output(constraint: Constraint) -> pb.StructuredOutput:
    value = constraint.value
    if isinstance(value, tuple):
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=value))
    if isinstance(value, bool):
        return pb.StructuredOutput(json_object=value)
    out = pb.StructuredOutput()
    setattr(out, constraint.kind, value)  # json_schema, regex or grammar: a string
    return out


def _request(call: Call, request_id: str, stage_id: str) -> opb.GenerateRequest:
    s = call.sampling
    sampling = pb.SamplingOverrides(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
        seed=s.seed, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
        min_p=s.min_p)
    req = pb.GenerationRequest(request_id=request_id, sampling=sampling, stop=list(call.stop),
                               logit_bias=dict(call.logit_bias), lora=call.lora,
                               ignore_eos=call.ignore_eos,
                               disable_spec_decode=call.disable_spec_decode,
                               logprobs=call.logprobs, prompt_logprobs=call.prompt_logprobs)
    if call.constraint is not None:
        req.structured_output.CopyFrom(_structured_output(call.constraint))
    if call.text is not None:
        req.text = call.text
    elif call.token_ids is not None:
        req.token_ids.ids.extend(call.token_ids)
    elif call.messages is not None:
        req.messages.messages.extend(_chat_message(role, content)
                                     for role, content in call.messages)
    req.media.extend(pb.MediaPart(mime_type=mime, data=data) for mime, data in call.images)
    return opb.GenerateRequest(request=req, sinks=[f"{stage_id}:text"])

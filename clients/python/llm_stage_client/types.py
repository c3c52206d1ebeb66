"""The library's own types and the conversions between them and the contract's messages.

Callers only ever see `Delta`, `FinalReport` and `StageClientError`; the protobuf messages stay
inside the library (`build_generate_request` and `event_from_pb` are for `client`/`aio`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import grpc
from google.protobuf.json_format import MessageToDict

from llm_stage_client._contract.llmstage.v1 import orchestrator_pb2 as opb
from llm_stage_client._contract.llmstage.v1 import stage_pb2 as pb
from llm_stage_client.controls import (
    JsonSchema,
    TokenLogprob,
    logprobs_from_pb,
    reject_str,
    structured_output,
)

_FINISH_PREFIX = "FINISH_REASON_"


# An image: encoded PNG / JPEG bytes, a file holding them, or (mime type, bytes).
ImageInput = bytes | str | os.PathLike[str] | tuple[str, bytes]
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"))


def media_part(image: ImageInput) -> pb.MediaPart:
    """The MediaPart for one image; the MIME type from the bytes' signature unless given
    (an unknown signature is sent as application/octet-stream and refused by the stage)."""
    if isinstance(image, tuple):
        mime, data = image
        return pb.MediaPart(mime_type=mime, data=bytes(data))
    if isinstance(image, bytes | bytearray):
        data = bytes(image)
    elif isinstance(image, str | os.PathLike):
        with open(image, "rb") as f:
            data = f.read()
    else:
        raise TypeError(f"an image is bytes, a path or (mime, bytes), not "
                        f"{type(image).__name__}")
    mime = next((m for sig, m in _MAGIC if data.startswith(sig)), "application/octet-stream")
    return pb.MediaPart(mime_type=mime, data=data)


def chat_message(role: str, content: str | Sequence[str | int]) -> pb.ChatMessage:
    """A chat message; content given as parts holds text (str) and images (int: the index
    of the image in `images`)."""
    if isinstance(content, str):
        return pb.ChatMessage(role=role, content=content)
    parts = [pb.ChatPart(image=p) if isinstance(p, int) else pb.ChatPart(text=p)
             for p in content]
    return pb.ChatMessage(role=role, parts=parts)


class GenerateOptions(TypedDict, total=False):
    """Keyword arguments of a generation besides the text prompt (see `build_generate_request`).

    `token_ids` or `messages` ((role, content) pairs) replace the text prompt; the sampling
    values replace the deployment defaults (None: keep the default); `sinks` are "stage:port"
    names to stream (empty: the topology's default sinks). At most one of `json_schema`,
    `json_object`, `regex`, `grammar` and `choice` constrains the output; `logprobs` and
    `prompt_logprobs` ask for log-probabilities (None: none; 0: each token's own; k: and the
    top k alternatives).
    """

    token_ids: Sequence[int]
    messages: Sequence[tuple[str, str | Sequence[str | int]]]
    images: Sequence[ImageInput]
    temperature: float | None
    top_k: int | None
    top_p: float | None
    max_tokens: int | None
    seed: int | None
    stop: Sequence[str]
    request_id: str
    sinks: Sequence[str]
    ignore_eos: bool
    adapter: str
    disable_spec_decode: bool
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    min_p: float | None
    logprobs: int | None
    prompt_logprobs: int | None
    json_schema: JsonSchema | None
    json_object: bool
    regex: str | None
    grammar: str | None
    choice: Sequence[str] | None


@dataclass(frozen=True)
class Delta:
    """New output of one sink port: the stage, the port, the new token ids and text. With
    `logprobs=` asked, `logprobs` holds one entry per token id, in order; with
    `prompt_logprobs=`, the request's first delta holds the prompt's, one per prompt token
    from the second on."""

    stage_id: str
    port: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class FinalReport:
    """The end of a request.

    `finish_reason` is the contract's enum name in lowercase without its prefix
    ("end_of_sequence", "max_length", "stop_words", "cancelled", "error"; "" when unspecified).
    `diagnostics` holds every active stage's diagnostics under its stage id; `route` the active
    stages in route order.
    """

    request_id: str
    finish_reason: str
    error: str
    prompt_tokens: int
    completion_tokens: int
    diagnostics: dict[str, Any]
    route: tuple[str, ...]


class StageClientError(Exception):
    """A call failed: `code` is the gRPC status name ("RESOURCE_EXHAUSTED"), `message` its
    details."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def error_from_rpc(exc: grpc.RpcError) -> StageClientError:
    """The `StageClientError` for a failed call (sync or `grpc.aio`)."""
    # Every RpcError a call raises is also a grpc.Call with code()/details(); the getattr guards
    # keep a bare RpcError (raised by interceptors or channel setup) from masking the failure.
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return StageClientError(name, details or str(exc))


def build_generate_request(
    *,
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[tuple[str, str | Sequence[str | int]]] | None = None,
    images: Sequence[ImageInput] = (),
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    max_tokens: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    request_id: str = "",
    sinks: Sequence[str] = (),
    ignore_eos: bool = False,
    adapter: str = "",
    disable_spec_decode: bool = False,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    min_p: float | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    json_schema: JsonSchema | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
) -> opb.GenerateRequest:
    """The GenerateRequest for these arguments.

    Exactly one of `prompt` (text), `token_ids` and `messages` ((role, content) pairs) must be
    given. Each sampling value is set only when not None, so the deployment default applies
    otherwise. `sinks` are "stage:port" names (empty: the topology's default sinks).
    `adapter` names the LoRA adapter the runner applies (empty: the base model).
    `disable_spec_decode` asks a speculative runner to decode this request plainly.
    `images` go to a vision-language runner: PNG / JPEG bytes, files, or (mime type, bytes).
    A message's content may be parts, text (str) and images (int, an index into `images`),
    which the chat template places; a text prompt places them with the model's own image
    token (e.g. "<image>"), one per image in order.
    `presence_penalty` and `frequency_penalty` ([-2, 2]) lower the logits of tokens already
    generated (once / per occurrence), `repetition_penalty` (> 0, 1 = off) those of tokens
    seen in the prompt or output, `min_p` ([0, 1]) drops tokens less likely than min_p times
    the likeliest. `logprobs` / `prompt_logprobs` (0..20) put log-probabilities on the deltas
    (see `Delta`). At most one of `json_schema` (JSON text or a dict), `json_object`, `regex`,
    `grammar` (Lark / EBNF / GBNF text) and `choice` (strings) constrains the output; a
    constraint the runner cannot compile is refused (INVALID_ARGUMENT, its reason said).

    Raises ValueError when not exactly one prompt form is given, two constraints are, or a
    value does not fit its field (e.g. a negative seed), TypeError when `stop`, `sinks` or
    `choice` is a bare string.
    """
    given = [name for name, value in (("prompt", prompt), ("token_ids", token_ids),
                                      ("messages", messages)) if value is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of prompt, token_ids, messages"
                         + (f" (got {', '.join(given)})" if given else ""))
    reject_str("stop", stop)
    reject_str("sinks", sinks)

    constraint = structured_output(json_schema=json_schema, json_object=json_object,
                                   regex=regex, grammar=grammar, choice=choice)
    # A keyword given None leaves its field unset: the deployment default (or off) applies.
    sampling = pb.SamplingOverrides(
        temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, seed=seed,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, min_p=min_p)
    req = pb.GenerationRequest(request_id=request_id, sampling=sampling, stop=list(stop),
                               ignore_eos=ignore_eos, lora=adapter,
                               disable_spec_decode=disable_spec_decode,
                               structured_output=constraint, logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs)
    if prompt is not None:
        req.text = prompt
    elif token_ids is not None:
        # SetInParent selects the oneof even for an empty list, so the server reports the empty
        # prompt instead of "no prompt".
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(token_ids)
    elif messages is not None:
        req.messages.SetInParent()
        req.messages.messages.extend(chat_message(role, content) for role, content in messages)
    if isinstance(images, bytes | str):
        raise TypeError("images takes a sequence of images: use [image]")
    req.media.extend(media_part(image) for image in images)
    return opb.GenerateRequest(request=req, sinks=list(sinks))


def finish_reason_name(value: int) -> str:
    """FINISH_REASON_MAX_LENGTH -> "max_length"; UNSPECIFIED -> ""."""
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return ""
    try:
        name = pb.FinishReason.Name(value)
    except ValueError:
        # A newer server may send a reason this stub does not know; keep the number visible.
        return f"unknown_{value}"
    return name.removeprefix(_FINISH_PREFIX).lower()


def delta_from_pb(delta: opb.Delta) -> Delta:
    """The library's Delta for a contract Delta."""
    return Delta(stage_id=delta.stage_id, port=delta.port, token_ids=tuple(delta.token_ids),
                 text=delta.text, logprobs=logprobs_from_pb(delta.logprobs),
                 prompt_logprobs=logprobs_from_pb(delta.prompt_logprobs))


def report_from_pb(final: opb.FinalReport) -> FinalReport:
    """The library's FinalReport for a contract FinalReport (Struct numbers become floats)."""
    return FinalReport(
        request_id=final.request_id,
        finish_reason=finish_reason_name(final.finish_reason),
        error=final.error,
        prompt_tokens=final.usage.prompt_tokens,
        completion_tokens=final.usage.completion_tokens,
        diagnostics=dict(MessageToDict(final.diagnostics)),
        route=tuple(final.route),
    )


def event_from_pb(event: opb.GenerateEvent) -> Delta | FinalReport | None:
    """The Delta or FinalReport an event carries; None for an empty event (a newer oneof member
    this stub does not know), which callers skip."""
    kind = event.WhichOneof("event")
    if kind == "delta":
        return delta_from_pb(event.delta)
    if kind == "final":
        return report_from_pb(event.final)
    return None


def topology_from_pb(response: opb.TopologyResponse) -> dict[str, Any]:
    """TopologyResponse as a dict with the proto's snake_case names and every field present
    (zero counts included, so `running` and `queued` are always there)."""
    return dict(MessageToDict(response, preserving_proto_field_name=True,
                              always_print_fields_with_no_presence=True))


def text_and_report(items: Sequence[Delta | FinalReport]) -> tuple[str, FinalReport]:
    """The joined text of every delta and the final report of a whole Generate stream.

    Raises StageClientError("UNKNOWN") when the stream ended without a final report.
    """
    reports = [item for item in items if isinstance(item, FinalReport)]
    if not reports:
        # The contract always ends a successful stream with one; a stream without it was cut.
        raise StageClientError("UNKNOWN", "the Generate stream ended without a final report")
    return "".join(item.text for item in items if isinstance(item, Delta)), reports[-1]

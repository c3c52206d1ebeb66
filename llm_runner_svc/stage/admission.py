"""Admission: the cheap checks that refuse a request before anything is allocated, prompt
tokenization, and the runtime request that Prepare builds."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from llm_runner_svc.errors import FailedPrecondition, InvalidArgument, NotFound, Unimplemented
from llm_runner_svc.models import Model
from llm_runner_svc.runtime import (
    GenerationRequest,
    InferenceRuntime,
    SamplingDefaults,
    SamplingParams,
    resolve,
)
from llm_runner_svc.runtime.constraint import Constraint
from llm_runner_svc.stage.config import StageConfig
from llm_runner_svc.stage.limits import RequestLimits, RequestSizes, check_malformed
from llm_runner_svc.stage.request import StageRequest
from services.stage.slot import Slot, SlotState


class Refusal(Enum):
    PROMPT_TOO_LONG = "prompt_too_long"
    NO_CAPACITY = "no_capacity"
    SAMPLING_OUT_OF_RANGE = "sampling_out_of_range"
    UNKNOWN_ADAPTER = "unknown_adapter"
    MEDIA_UNSUPPORTED = "media_unsupported"
    PORT_UNAVAILABLE = "port_unavailable"
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"
    NO_CHAT_TEMPLATE = "no_chat_template"
    MEDIA_INVALID = "media_invalid"
    STRUCTURED_OUTPUT = "structured_output"


class Refused(Exception):
    """Raised by the checks below; admission turns it into admitted=false."""

    def __init__(self, refusal: Refusal, reason: str) -> None:
        super().__init__(reason)
        self.refusal = refusal
        self.reason = reason


@dataclass(frozen=True)
class Admission:
    is_admitted: bool
    refusal: Refusal | None = None
    reason: str = ""
    prompt_tokens: int = 0


def check_request(config: StageConfig, model: Model, max_seq: int, req: StageRequest,
                  num_live: int, adapters: Sequence[str] | None = None) -> None:
    """Refusals that need no tokenization, cheapest first. A prompt too large to tokenize
    cheaply, or an over-long request id, is malformed (INVALID_ARGUMENT), not refused.
    `adapters`: the LoRA adapter names served now (default: config.lora_adapters)."""
    check_malformed(config.limits, max_seq, req)
    capacity = config.max_batch + config.max_waiting
    if num_live >= capacity:
        raise Refused(Refusal.NO_CAPACITY, f"the stage holds {num_live} requests, its limit "
                      f"(maxBatch {config.max_batch} + {config.max_waiting} waiting)")
    check_limits(config.limits, max_seq, req)
    names = list(adapters) if adapters is not None else [n for n, _ in config.lora_adapters]
    if req.lora and req.lora not in names:
        known = f"it serves {names}" if names else "it loads no adapters"
        raise Refused(Refusal.UNKNOWN_ADAPTER,
                      f"LoRA adapter {req.lora!r} is unknown to this stage; {known}")
    if req.num_media and model.vision is None:
        raise Refused(Refusal.MEDIA_UNSUPPORTED, f"the request carries {req.num_media} media "
                      f"item(s) and this stage's model ({model.name}) is text-only: it has no "
                      "vision tower")
    for port in req.ports:
        if port not in config.emits:
            raise Refused(Refusal.PORT_UNAVAILABLE, f"port {port!r} is not declared by this "
                          f"deployment (it emits {list(config.emits)})")
    try:
        sampling_params(config.sampling, req)
    except InvalidArgument as exc:
        raise Refused(Refusal.SAMPLING_OUT_OF_RANGE, exc.message) from exc
    vocab = model.config.vocab_size
    bad = [t for t in req.logit_bias if t >= vocab]
    if bad:
        raise Refused(Refusal.SAMPLING_OUT_OF_RANGE,
                      f"logit_bias names token {bad[0]}, outside 0..{vocab - 1}")
    if req.messages is not None and model.chat_template is None:
        raise Refused(Refusal.NO_CHAT_TEMPLATE,
                      f"model {model.name} has no chat template; send text or token_ids")


def sampling_params(defaults: SamplingDefaults, req: StageRequest, seed: int = 0
                    ) -> SamplingParams:
    """The request's sampling values over the deployment's `defaults`; InvalidArgument naming
    the field for one out of its range."""
    return resolve(defaults, temperature=req.temperature, top_k=req.top_k,
                   top_p=req.top_p, max_new_tokens=req.max_tokens, seed=seed,
                   logit_bias=req.logit_bias, presence_penalty=req.presence_penalty,
                   frequency_penalty=req.frequency_penalty,
                   repetition_penalty=req.repetition_penalty, min_p=req.min_p,
                   logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs)


def check_features(runtime: InferenceRuntime, req: StageRequest) -> None:
    """Refuse at Admit what the stage's engine cannot give, rather than when the request
    joins a Step stream: log-probabilities, prompt log-probabilities, penalties, min_p (a
    value that leaves one off asks nothing)."""
    try:
        runtime.check_sampling(sampling_params(runtime.config.sampling, req))
    except Unimplemented as exc:
        raise Refused(Refusal.SAMPLING_OUT_OF_RANGE, exc.message) from exc
    except InvalidArgument:
        return  # a value out of range: check_request refuses it, naming the field


def check_constraint(runtime: InferenceRuntime, constraint: Constraint) -> None:
    """Refuse a structured output the runtime cannot serve: its schema, regex or grammar does
    not compile, or the engine cannot mask tokens. Tens of milliseconds for a large schema
    the first time: the stage runs it on its worker thread, with tokenization."""
    try:
        runtime.check_constraint(constraint)
    except (InvalidArgument, Unimplemented, FailedPrecondition) as exc:
        reason = exc.message if "structured output" in exc.message else \
            f"structured output ({constraint.kind}) cannot be served: {exc.message}"
        raise Refused(Refusal.STRUCTURED_OUTPUT, reason) from exc


def check_counts(limits: RequestLimits, max_seq: int, sizes: RequestSizes) -> None:
    """The stage's per-request limits on counts (limits.py), which Admit checks on the wire
    message before converting it: stop strings and logit bias are generation controls
    (SAMPLING_OUT_OF_RANGE), chat turns and token ids are prompt (PROMPT_TOO_LONG), media
    parts MEDIA_UNSUPPORTED."""
    if sizes.num_stop > limits.max_stop_strings:
        raise Refused(Refusal.SAMPLING_OUT_OF_RANGE, f"the request has {sizes.num_stop} stop "
                      f"strings; the limit is {limits.max_stop_strings} (maxStopStrings)")
    if sizes.num_logit_bias > limits.max_logit_bias:
        raise Refused(Refusal.SAMPLING_OUT_OF_RANGE, f"logit_bias has {sizes.num_logit_bias} "
                      f"entries; the limit is {limits.max_logit_bias} (maxLogitBias)")
    if sizes.num_messages > limits.max_messages:
        raise Refused(Refusal.PROMPT_TOO_LONG, f"the request has {sizes.num_messages} chat "
                      f"messages; the limit is {limits.max_messages} (maxMessages)")
    if sizes.num_token_ids >= max_seq:
        raise Refused(Refusal.PROMPT_TOO_LONG, f"prompt has {sizes.num_token_ids} tokens; "
                      f"maxSeq is {max_seq}, which leaves no room to generate")
    if sizes.num_media > limits.max_media_parts:
        raise Refused(Refusal.MEDIA_UNSUPPORTED, f"the request has {sizes.num_media} media "
                      f"parts; the limit is {limits.max_media_parts} (maxMediaParts)")
    for i, size in enumerate(sizes.media_bytes):
        if size > limits.max_media_bytes:
            raise Refused(Refusal.MEDIA_INVALID, f"media[{i}] holds {size} bytes; the limit "
                          f"is {limits.max_media_bytes} (maxMediaBytes)")


def check_limits(limits: RequestLimits, max_seq: int, req: StageRequest) -> None:
    """Every per-request limit on a converted request: the counts, then the stop bytes and
    the structured output's."""
    check_counts(limits, max_seq, RequestSizes.of(req))
    stop_bytes = sum(len(s.encode()) for s in req.stop)
    if stop_bytes > limits.max_stop_bytes:
        raise Refused(Refusal.SAMPLING_OUT_OF_RANGE, f"the stop strings hold {stop_bytes} "
                      f"bytes; the limit is {limits.max_stop_bytes} (maxStopBytes)")
    grammar_bytes = req.grammar_bytes
    if grammar_bytes > limits.max_grammar_bytes:
        assert req.constraint is not None
        raise Refused(Refusal.STRUCTURED_OUTPUT, f"the structured output's "
                      f"{req.constraint.kind} holds {grammar_bytes} bytes; the limit is "
                      f"{limits.max_grammar_bytes} (maxGrammarBytes)")


def tokenize(model: Model, req: StageRequest) -> tuple[int, ...]:
    """The prompt's token ids (chat template rendered first). Linear-ish in the prompt's
    size, but still milliseconds for kilobytes: the stage runs it on a worker thread."""
    tok = model.tokenizer
    if req.token_ids is not None:
        return req.token_ids
    if req.messages is not None:
        assert model.chat_template is not None
        text = model.chat_template.render(
            [{"role": m.role, "content": m.template_content()} for m in req.messages])
        return tuple(tok.encode(text, add_bos=False))
    assert req.text is not None
    return tuple(tok.encode(req.text, add_bos=tok.default_add_bos()))


def check_prompt(model: Model, runtime: InferenceRuntime, prompt_ids: tuple[int, ...]) -> None:
    if len(prompt_ids) >= runtime.max_seq:
        raise Refused(Refusal.PROMPT_TOO_LONG, f"prompt has {len(prompt_ids)} tokens; maxSeq is "
                      f"{runtime.max_seq}, which leaves no room to generate")
    vocab = model.config.vocab_size
    bad = max(prompt_ids) if max(prompt_ids) >= vocab else min(prompt_ids)
    if not 0 <= bad < vocab:
        raise Refused(Refusal.TOKEN_OUT_OF_VOCAB,
                      f"prompt holds token id {bad}, outside 0..{vocab - 1}")


def token_budget(config: StageConfig, max_seq: int, req: StageRequest, num_prompt: int) -> int:
    """KV positions a request may come to hold: its prompt and what it may generate."""
    max_new = req.max_tokens or config.sampling.max_generate_length
    return num_prompt + max(0, min(max_new, max_seq - num_prompt))


def is_queued(slot: Slot) -> bool:
    """Admitted and still to run: not yet joined to a Step stream."""
    return slot.state in (SlotState.ADMITTED, SlotState.PREPARED)


def tokens_in_flight(config: StageConfig, max_seq: int, slots: Iterable[Slot]) -> int:
    """The token budgets of every slot whose run has not ended."""
    return sum(token_budget(config, max_seq, s.request, len(s.admitted)) for s in slots
               if s.state.is_live)


def check_load(config: StageConfig, max_seq: int, slots: Iterable[Slot], num_waiting: int,
               req: StageRequest, num_prompt: int) -> None:
    """The stage's own protection: limits on queued requests and on tokens in flight
    (each off when 0). Requests in the runtime's waiting queue count as queued too."""
    if config.max_queued:
        num_queued = sum(1 for s in slots if is_queued(s)) + num_waiting
        if num_queued >= config.max_queued:
            raise Refused(Refusal.NO_CAPACITY, f"queue full: {num_queued} requests wait to "
                          f"run, the limit (maxQueued) is {config.max_queued}")
    if config.max_tokens_in_flight:
        held = tokens_in_flight(config, max_seq, slots)
        need = token_budget(config, max_seq, req, num_prompt)
        if held + need > config.max_tokens_in_flight:
            raise Refused(Refusal.NO_CAPACITY, f"token budget full: {held} tokens in flight + "
                          f"{need} for this request exceed the limit (maxTokensInFlight) of "
                          f"{config.max_tokens_in_flight}")


@dataclass(frozen=True)
class PreparedRun:
    """What Prepare builds: the runtime's request and the seed it draws with."""

    request: GenerationRequest
    seed: int


def build_runtime_request(runtime: InferenceRuntime, slot: Slot,
                          adapters: Sequence[str | None] = ()) -> PreparedRun:
    """The runtime's request for a slot; an unset seed is drawn here and reported later.
    `adapters`: the LoRA adapter name in each engine adapter slot 1, 2, ... (None: empty).
    NotFound for a request whose adapter was unloaded after it was admitted."""
    req = slot.request
    if req.lora and req.lora not in adapters:
        raise NotFound(f"LoRA adapter {req.lora!r} was unloaded after the request was "
                       "admitted")
    adapter = adapters.index(req.lora) + 1 if req.lora else 0
    seed = secrets.randbits(64) if req.seed is None else req.seed
    sampling = sampling_params(runtime.config.sampling, req, seed)
    return PreparedRun(GenerationRequest(
        slot.runtime_id, slot.admitted, sampling, stop=req.stop, capture_hidden=req.wants_hidden,
        ignore_eos=req.ignore_eos, label=req.request_id, cache_lookup=req.cache_lookup,
        cache_generated=req.cache_generated, adapter=adapter,
        disable_spec_decode=req.disable_spec_decode,
        embeds=getattr(slot.admitted, "embeds", ()), constraint=req.constraint), seed)

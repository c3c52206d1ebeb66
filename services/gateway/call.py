"""An OpenAI request body -> a `Call`: what one prompt's generations ask of the orchestrator.

`parse_chat` and `parse_completions` (one Call per prompt of a batch; `parse_completion` for
a single prompt) take the decoded JSON body and raise `BadField` (HTTP 400) naming the field
(`param`) for anything malformed or not supported; they check the ranges OpenAI states
(temperature [0, 2], penalties [-2, 2], min_p [0, 1], at most 20 log-probabilities) but leave
the ones the stages own (top_p, top_k, the prompt's length) to the stage, which refuses them at
Admit, and those reach the caller as 400 too. Keys that change nothing here (`store`,
`metadata`, `service_tier`, `priority`, ...) are ignored; every field OpenAI or vLLM defines
that would change the output and that this service cannot honour (`suffix`,
`reasoning_effort`, beam search, `min_tokens`, ...) is refused rather than silently ignored,
unless its value asks for nothing (min_tokens 0, use_beam_search false, ...). Honoured:
structured output (constraints.py), tools (tools.py), log-probabilities, `echo`, `n`, the
penalties, min_p. Extensions beyond OpenAI are top-level keys (what the `openai` client's
`extra_body` sends): `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `lora`,
`disable_spec_decode`, vLLM's `guided_*` and `structured_outputs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from services.errors import InvalidArgument
from services.gateway.constraints import Constraint, constraint_of, exclusive
from services.gateway.errors import BadField
from services.gateway.fields import (
    MAX_TOKEN_ID,
    is_int,
    logit_bias,
    opt_bool,
    opt_float,
    opt_int,
    ranged,
    stop,
)
from services.gateway.messages import Messages, messages_of
from services.gateway.tools import ToolPlan, tool_plan_of

__all__ = ["MAX_TOKEN_ID", "BadField", "Call", "Sampling", "messages_of", "parse_chat",
           "parse_completion", "parse_completions"]

MAX_SEED = (1 << 64) - 1
MAX_LOGPROBS = 20  # the contract's most alternatives per position
MAX_CHOICES = 128  # n: each choice is its own Generate call
MAX_PENALTY = 2.0  # OpenAI's presence and frequency penalties are in [-2, 2]
# Fields that change the output, refused unless their value asks for nothing (None, False, 0,
# 1, ...): OpenAI's, then vLLM's sampling and structured-output extensions. Nothing that would
# change what a request generates is ignored.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "suffix": (None, ""), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    "modalities": (None, ["text"]),
    "min_tokens": (None, 0),
    "length_penalty": (None, 1), "use_beam_search": (None, False),
    "early_stopping": (None, False), "stop_token_ids": (None, []),
    "bad_words": (None, []), "allowed_token_ids": (None,), "logits_processors": (None, []),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,), "typical_p": (None, 1), "top_a": (None, 0),
    "guided_whitespace_pattern": (None,), "structural_tag": (None,),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "documents": (None, []), "mm_processor_kwargs": (None, {}),
    "include_reasoning": (None, True), "prompt_embeds": (None,),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
    "vllm_xargs": (None, {}),
}
# Refused by one endpoint only: a chat turn is not echoed; tools are chat's.
_UNSUPPORTED_BY_KIND: dict[str, dict[str, tuple[Any, ...]]] = {
    "chat": {"echo": (None, False)},
    "completion": {"tools": (None, []), "tool_choice": (None, "none"),
                   "top_logprobs": (None, 0)},
}
_WHY = {"reasoning_effort": "no reasoning model is served here",
        "suffix": "insertion (a text after the completion) is not supported"}
# Special tokens the prompt's tokenization adds: the stage adds the model's BOS to a text prompt
# (vLLM's completions default) and none to a rendered conversation (its chat default).
_ADD_SPECIAL_TOKENS = {"chat": (None, False), "completion": (None, True)}
MAX_TEMPERATURE = 2.0  # OpenAI's limit


@dataclass(frozen=True)
class Sampling:
    """Values replacing the deployment's defaults; None keeps the default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None


@dataclass(frozen=True)
class Call:
    """One prompt's generation(s): exactly one of `text`, `token_ids`, `messages` is set."""

    kind: str  # "chat" or "completion"
    model: str
    is_stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: Messages | None = None
    images: tuple[tuple[str, bytes], ...] = ()  # (MIME type, encoded bytes) of image_url parts
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    user: str = ""
    ignore_eos: bool = False
    disable_spec_decode: bool = False  # decode plainly on a speculative runner
    lora: str = ""
    n: int = 1  # choices: each its own generation (seed + i when a seed is given)
    constraint: Constraint | None = None
    tools: ToolPlan | None = None
    logprobs: int | None = None  # the generated tokens': None none, k the top k too
    echo: bool = False  # a completion's text starts with its prompt
    # echo with max_tokens 0: the stage generates at least one token, which is dropped
    is_prompt_only: bool = False

    @property
    def prompt_logprobs(self) -> int | None:
        """The prompt's log-probabilities are asked for by echo with logprobs."""
        return self.logprobs if self.echo else None

    def for_choice(self, index: int) -> Call:
        """The Call of choice `index` of n: the seed moved by the index, so the choices
        differ and each is reproducible."""
        seed = self.sampling.seed
        if index == 0 or seed is None:
            return self
        return replace(self, sampling=replace(self.sampling, seed=(seed + index) & MAX_SEED))


def parse_chat(body: Any) -> Call:
    """A `/v1/chat/completions` body."""
    body = _object(body)
    _refuse_unsupported(body, "chat")
    max_tokens = opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens", 1)
    plan = tool_plan_of(body)
    images: list[tuple[str, bytes]] = []
    messages = messages_of(body.get("messages"), images)
    if plan is not None:
        messages = _with_system(messages, plan.prompt())
    is_logprobs = opt_bool(body, "logprobs")
    top = opt_int(body, "top_logprobs", 0)
    if top is not None and top > MAX_LOGPROBS:
        raise BadField("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}]")
    if top and not is_logprobs:
        raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
    constraint = exclusive(constraint_of(body), plan.constraint() if plan else None)
    return Call(kind="chat", messages=messages, images=tuple(images), tools=plan,
                logprobs=(top or 0) if is_logprobs else None,
                **_common(body, max_tokens, constraint))


def parse_completion(body: Any) -> Call:
    """A `/v1/completions` body of one prompt, as text or token ids."""
    calls = parse_completions(body)
    if len(calls) > 1:
        raise BadField("prompt", "one prompt expected here, got a list of several")
    return calls[0]


def parse_completions(body: Any) -> tuple[Call, ...]:
    """A `/v1/completions` body: one Call per prompt. `prompt` is a string, a list of token
    ids, or a list of several of either (a batch: choices i*n .. i*n+n-1 answer prompt i). A
    batch does not stream (refused naming `stream`)."""
    body = _object(body)
    _refuse_unsupported(body, "completion")
    prompt = body.get("prompt")
    is_echo = bool(opt_bool(body, "echo"))
    max_tokens = opt_int(body, "max_tokens", 0 if is_echo else 1)
    logprobs = body.get("logprobs")
    if logprobs is not None and not (is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
        raise BadField("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (the "
                       "alternatives listed per token)")
    # The stage refuses max_tokens 0 (a request generates at least one token): a prompt-only
    # echo asks for one and drops it.
    common = _common(body, 1 if max_tokens == 0 else max_tokens, constraint_of(body))
    common.update(echo=is_echo, logprobs=logprobs, is_prompt_only=max_tokens == 0)
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(is_int(t) for t in prompt)):
        return (_completion(prompt, "prompt", common),)
    if not (isinstance(prompt, list) and prompt):
        raise BadField("prompt", "prompt must be a string, a list of token ids, or a "
                       "non-empty list of either")
    if len(prompt) > 1 and common["is_stream"]:
        raise BadField("stream", "a list of several prompts is answered whole: stream must "
                       "be false (or send one request per prompt)")
    return tuple(_completion(p, f"prompt[{i}]", common) for i, p in enumerate(prompt))


def _completion(prompt: Any, where: str, common: dict[str, Any]) -> Call:
    if isinstance(prompt, str):
        return Call(kind="completion", text=prompt, **common)
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        if not all(0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise BadField("prompt", f"{where}: token ids must be in [0, 2^31)")
        return Call(kind="completion", token_ids=tuple(prompt), **common)
    raise BadField("prompt", f"{where} must be a string or a non-empty list of token ids")


def _common(body: dict[str, Any], max_tokens: int | None, constraint: Constraint | None
            ) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadField("model", "model is required (GET /v1/models lists them)")
    n = opt_int(body, "n", 1) or 1
    if n > MAX_CHOICES:
        raise BadField("n", f"n must be in [1, {MAX_CHOICES}]")
    best_of = opt_int(body, "best_of", 1)
    if best_of not in (None, n):
        raise BadField("best_of", f"best_of must equal n ({n}): this server returns every "
                       "generation it runs and ranks none")
    opt_bool(body, "parallel_tool_calls")  # honoured with tools (tools.py)
    is_stream = opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (is_stream and isinstance(options, dict)):
        raise BadField("stream_options", "stream_options is an object, only with stream: true")
    include_usage = bool(opt_bool(options or {}, "include_usage"))
    if opt_bool(options or {}, "continuous_usage_stats"):
        raise BadField("stream_options", "stream_options.continuous_usage_stats is not "
                       "supported: the usage comes in the last chunk (include_usage)")
    seed = opt_int(body, "seed", 0)
    if seed is not None and seed > MAX_SEED:
        raise BadField("seed", "seed must be in [0, 2^64)")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadField("user", "user must be a string")
    lora = body.get("lora")
    if lora is not None and not isinstance(lora, str):
        raise BadField("lora", "lora must be a string (an adapter name)")
    sampling = Sampling(
        temperature=ranged(body, "temperature", 0, MAX_TEMPERATURE),
        top_p=opt_float(body, "top_p"), top_k=opt_int(body, "top_k", 0),
        max_tokens=max_tokens, seed=seed,
        presence_penalty=ranged(body, "presence_penalty", -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=ranged(body, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY),
        repetition_penalty=ranged(body, "repetition_penalty", 0, math.inf, is_low_open=True),
        min_p=ranged(body, "min_p", 0, 1))
    return {"model": model, "is_stream": bool(is_stream), "include_usage": include_usage,
            "sampling": sampling, "stop": stop(body.get("stop")),
            "logit_bias": logit_bias(body.get("logit_bias")), "user": user or "",
            "ignore_eos": bool(opt_bool(body, "ignore_eos")), "lora": lora or "",
            "disable_spec_decode": bool(opt_bool(body, "disable_spec_decode")), "n": n,
            "constraint": constraint}


def _with_system(messages: Messages, text: str) -> Messages:
    """`text` as the conversation's system message: after the first one's text, or a new
    first message (chat templates take the system message first)."""
    if messages[0][0] == "system" and isinstance(messages[0][1], str):
        return (("system", f"{messages[0][1]}\n\n{text}"), *messages[1:])
    return (("system", text), *messages)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return body


def _refuse_unsupported(body: dict[str, Any], kind: str) -> None:
    for key, neutral in (*_UNSUPPORTED.items(), *_UNSUPPORTED_BY_KIND[kind].items(),
                         ("add_special_tokens", _ADD_SPECIAL_TOKENS[kind])):
        if key in body and not _asks_nothing(body[key], neutral):
            why = _WHY.get(key, "it would change the output")
            raise BadField(key, f"{key} is not supported by this server ({why})")


def _asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether `value` is one of `neutral`, a boolean never standing for a number (True == 1
    in Python) nor a number for a boolean."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)

"""An OpenAI request body -> a `Call`: what one generation asks of the orchestrator.

`parse_chat` and `parse_completions` (one Call per prompt of a batch; `parse_completion` for
a single prompt) take the decoded JSON body and raise `InvalidArgument`
(HTTP 400) naming the field (`param`) for anything malformed or not supported; they check
temperature against OpenAI's [0, 2] but leave the ranges the stages own (top_p, top_k, the
prompt's length) to the stage, which refuses them at Admit, and those reach the caller as 400
too. Keys that change nothing here (`store`, `metadata`, `service_tier`, `priority`, ...) are
ignored; every field OpenAI or vLLM defines that would change the output and that this service
cannot honour (tools, log probabilities, penalties, min_p, guided decoding, beam search, several
choices, ...) is refused rather than silently ignored, unless its value asks for nothing
(repetition_penalty 1, min_p 0, ...). Extensions beyond OpenAI are top-level keys (what the
`openai` client's `extra_body` sends): `top_k`, `ignore_eos`, `lora`, `disable_spec_decode`.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass, field
from typing import Any

from services.errors import InvalidArgument

MAX_SEED = (1 << 64) - 1
MAX_TOKEN_ID = (1 << 31) - 1
# OpenAI's roles; "developer" is its newer name for "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields that change the output, refused unless their value asks for nothing (None, False, 0,
# 1, ...): OpenAI's, then vLLM's sampling and structured-output extensions. Nothing that would
# change what a request generates is ignored.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "best_of": (None, 1),
    "echo": (None, False), "suffix": (None, ""), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    "modalities": (None, ["text"]),
    "repetition_penalty": (None, 1), "min_p": (None, 0), "min_tokens": (None, 0),
    "length_penalty": (None, 1), "use_beam_search": (None, False),
    "early_stopping": (None, False), "stop_token_ids": (None, []),
    "bad_words": (None, []), "allowed_token_ids": (None,), "logits_processors": (None, []),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,), "typical_p": (None, 1), "top_a": (None, 0),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "guided_whitespace_pattern": (None,),
    "structural_tag": (None,), "structured_outputs": (None,),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "documents": (None, []), "mm_processor_kwargs": (None, {}),
    "include_reasoning": (None, True), "prompt_embeds": (None,),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
    "vllm_xargs": (None, {}),
}
# Special tokens the prompt's tokenization adds: the stage adds the model's BOS to a text prompt
# (vLLM's completions default) and none to a rendered conversation (its chat default).
_ADD_SPECIAL_TOKENS = {"chat": (None, False), "completion": (None, True)}
# Tool calls are refused (tools above): parallel_tool_calls, true or false, asks nothing.
_BOOLEANS = ("parallel_tool_calls",)
MAX_TEMPERATURE = 2.0  # OpenAI's limit
_RESPONSE_FORMATS = (None, {"type": "text"})


class BadField(InvalidArgument):
    """A malformed or unsupported field; `param` names it as OpenAI's error bodies do."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Sampling:
    """Values replacing the deployment's defaults; None keeps the default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Call:
    """One generation: exactly one of `text`, `token_ids`, `messages` is set."""

    kind: str  # "chat" or "completion"
    model: str
    is_stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    # (role, content), oldest first; content with images is parts: text (str) and images
    # (int, an index into `images`)
    messages: tuple[tuple[str, str | tuple[str | int, ...]], ...] | None = None
    images: tuple[tuple[str, bytes], ...] = ()  # (MIME type, encoded bytes) of image_url parts
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    user: str = ""
    ignore_eos: bool = False
    disable_spec_decode: bool = False  # decode plainly on a speculative runner
    lora: str = ""


def parse_chat(body: Any) -> Call:
    """A `/v1/chat/completions` body."""
    body = _object(body)
    _refuse_unsupported(body, "chat")
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    images: list[tuple[str, bytes]] = []
    return Call(kind="chat", messages=messages_of(body.get("messages"), images),
                images=tuple(images), **_common(body, max_tokens))


def parse_completion(body: Any) -> Call:
    """A `/v1/completions` body of one prompt, as text or token ids."""
    calls = parse_completions(body)
    if len(calls) > 1:
        raise BadField("prompt", "one prompt expected here, got a list of several")
    return calls[0]


def parse_completions(body: Any) -> tuple[Call, ...]:
    """A `/v1/completions` body: one Call per prompt. `prompt` is a string, a list of token
    ids, or a list of several of either (a batch: choice i answers prompt i). A batch does not
    stream (refused naming `stream`)."""
    body = _object(body)
    _refuse_unsupported(body, "completion")
    prompt = body.get("prompt")
    common = _common(body, _opt_int(body, "max_tokens", 1))
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(_is_int(t) for t in prompt)):
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
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise BadField("prompt", f"{where}: token ids must be in [0, 2^31)")
        return Call(kind="completion", token_ids=tuple(prompt), **common)
    raise BadField("prompt", f"{where} must be a string or a non-empty list of token ids")


def _common(body: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadField("model", "model is required (GET /v1/models lists them)")
    if body.get("n") not in (None, 1):
        raise BadField("n", "n must be 1: one choice per request")
    is_stream = _opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (is_stream and isinstance(options, dict)):
        raise BadField("stream_options", "stream_options is an object, only with stream: true")
    include_usage = bool(_opt_bool(options or {}, "include_usage"))
    if _opt_bool(options or {}, "continuous_usage_stats"):
        raise BadField("stream_options", "stream_options.continuous_usage_stats is not "
                       "supported: the usage comes in the last chunk (include_usage)")
    temperature = _opt_float(body, "temperature")
    if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
        raise BadField("temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], "
                       f"got {temperature:g}")
    seed = _opt_int(body, "seed", 0)
    if seed is not None and seed > MAX_SEED:
        raise BadField("seed", "seed must be in [0, 2^64)")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadField("user", "user must be a string")
    lora = body.get("lora")
    if lora is not None and not isinstance(lora, str):
        raise BadField("lora", "lora must be a string (an adapter name)")
    sampling = Sampling(temperature=temperature,
                        top_p=_opt_float(body, "top_p"), top_k=_opt_int(body, "top_k", 0),
                        max_tokens=max_tokens, seed=seed)
    return {"model": model, "is_stream": bool(is_stream), "include_usage": include_usage,
            "sampling": sampling, "stop": _stop(body.get("stop")),
            "logit_bias": _logit_bias(body.get("logit_bias")), "user": user or "",
            "ignore_eos": bool(_opt_bool(body, "ignore_eos")), "lora": lora or "",
            "disable_spec_decode": bool(_opt_bool(body, "disable_spec_decode"))}


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return body


def _refuse_unsupported(body: dict[str, Any], kind: str) -> None:
    for key, neutral in (*_UNSUPPORTED.items(), ("add_special_tokens", _ADD_SPECIAL_TOKENS[kind])):
        if key in body and not _asks_nothing(body[key], neutral):
            raise BadField(key, f"{key} is not supported by this server (it would change the "
                           "output)")
    if not _asks_nothing(body.get("response_format"), _RESPONSE_FORMATS):
        raise BadField("response_format", "response_format other than text is not supported")
    for key in _BOOLEANS:
        _opt_bool(body, key)


def _asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether `value` is one of `neutral`, a boolean never standing for a number (True == 1
    in Python) nor a number for a boolean."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def messages_of(value: Any, images: list[tuple[str, bytes]]
                ) -> tuple[tuple[str, str | tuple[str | int, ...]], ...]:
    """A chat body's `messages` as (role, content) pairs, each image appended to `images`."""
    if not isinstance(value, list) or not value:
        raise BadField("messages", "messages must be a non-empty list")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise BadField(where, f"{where} must be an object")
        role = _ROLES.get(msg.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise BadField(f"{where}.role", f"{where}.role must be one of "
                           f"{', '.join(sorted(_ROLES))}, got {msg.get('role')!r}")
        if msg.get("tool_calls") not in (None, []):
            raise BadField(f"{where}.tool_calls", f"{where}.tool_calls: tool calls are not "
                           "supported by this server")
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""  # OpenAI's shape of an assistant turn that only called tools
        out.append((role, _content(content, f"{where}.content", images)))
    return tuple(out)


def _content(value: Any, where: str, images: list[tuple[str, bytes]]
             ) -> str | tuple[str | int, ...]:
    """A message's content: a string, text parts joined, or (with image_url parts) its
    parts, each image appended to `images` and named by its index there."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts: list[str | int] = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "image_url":
                images.append(_data_url(part.get("image_url"), f"{where}[{i}].image_url"))
                parts.append(len(images) - 1)
            else:
                raise BadField(where, f"{where}: only text and image_url parts are supported")
        if all(isinstance(p, str) for p in parts):
            return "".join(p for p in parts if isinstance(p, str))
        return tuple(parts)
    raise BadField(where, f"{where} must be a string or a list of text and image_url parts")


def _data_url(value: Any, where: str) -> tuple[str, bytes]:
    """An image_url's `url` as (MIME type, bytes): only base64 data: URLs (this server
    fetches nothing)."""
    url = value.get("url") if isinstance(value, dict) else None
    if not isinstance(url, str):
        raise BadField(where, f"{where}.url must be a string")
    match = re.fullmatch(r"data:([\w.+/-]+);base64,(.*)", url, flags=re.S)
    if match is None:
        raise BadField(where, f"{where}.url: only data:<mime>;base64,... URLs are supported "
                       "(this server fetches no remote images)")
    try:
        data = base64.b64decode(match.group(2), validate=True)
    except binascii.Error as exc:
        raise BadField(where, f"{where}.url: the base64 data does not decode ({exc})") from exc
    return match.group(1), data


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise BadField("stop", "stop must be a string or a list of strings")


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise BadField("logit_bias", "logit_bias must be an object of token id -> bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadField("logit_bias", f"logit_bias key {key!r} is not a token id") from None
        if not 0 <= token <= MAX_TOKEN_ID:
            raise BadField("logit_bias", f"logit_bias key {key!r} is out of range")
        if not (_is_number(bias) and -100 <= bias <= 100):
            raise BadField("logit_bias", f"logit_bias[{key}] must be a number in [-100, 100]")
        out.append((token, float(bias)))
    return tuple(out)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _opt_bool(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadField(key, f"{key} must be true or false")
    return value


def _opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise BadField(key, f"{key} must be an integer >= {minimum}")
    return int(value)


def _opt_float(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_number(value):
        raise BadField(key, f"{key} must be a finite number")
    return float(value)

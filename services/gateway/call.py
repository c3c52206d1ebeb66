"""An OpenAI request body -> a `Call`: what one generation asks of the orchestrator.

`parse_chat` and `parse_completion` take the decoded JSON body and raise `InvalidArgument`
(HTTP 400) naming the field (`param`) for anything malformed or not supported; they do not
check value ranges the stages own (temperature, top_p, top_k, the prompt's length), which the
stage refuses at Admit and which reach the caller as 400 too. Keys OpenAI defines that change
nothing here (`store`, `metadata`, `parallel_tool_calls`, ...) are ignored; features this
service cannot honour (tools, log probabilities, penalties, several choices) are refused rather
than silently ignored. Extensions beyond OpenAI are top-level keys (what the `openai` client's
`extra_body` sends): `top_k`, `ignore_eos`, `lora`, `disable_spec_decode`.
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
# Features refused unless their value is one that asks for nothing (None, False, 0, 1, ...).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "best_of": (None, 1),
    "echo": (None, False), "suffix": (None, ""), "audio": (None,), "prediction": (None,),
}
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
    _refuse_unsupported(body, _UNSUPPORTED)
    if body.get("response_format") not in _RESPONSE_FORMATS:
        raise BadField("response_format", "response_format other than text is not supported")
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    images: list[tuple[str, bytes]] = []
    return Call(kind="chat", messages=_messages(body.get("messages"), images),
                images=tuple(images), **_common(body, max_tokens))


def parse_completion(body: Any) -> Call:
    """A `/v1/completions` body: one prompt, as text or token ids."""
    body = _object(body)
    _refuse_unsupported(body, _UNSUPPORTED)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    common = _common(body, _opt_int(body, "max_tokens", 1))
    if isinstance(prompt, str):
        return Call(kind="completion", text=prompt, **common)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise BadField("prompt", "prompt token ids must be in [0, 2^31)")
        return Call(kind="completion", token_ids=tuple(prompt), **common)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadField("prompt", "one prompt per request (send several requests)")
    raise BadField("prompt", "prompt must be a string or a list of token ids")


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
    seed = _opt_int(body, "seed", 0)
    if seed is not None and seed > MAX_SEED:
        raise BadField("seed", "seed must be in [0, 2^64)")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadField("user", "user must be a string")
    lora = body.get("lora")
    if lora is not None and not isinstance(lora, str):
        raise BadField("lora", "lora must be a string (an adapter name)")
    sampling = Sampling(temperature=_opt_float(body, "temperature"),
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


def _refuse_unsupported(body: dict[str, Any], table: dict[str, tuple[Any, ...]]) -> None:
    for key, neutral in table.items():
        if key in body and body[key] not in neutral:
            raise BadField(key, f"{key} is not supported by this server")


def _messages(value: Any, images: list[tuple[str, bytes]]
              ) -> tuple[tuple[str, str | tuple[str | int, ...]], ...]:
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
        out.append((role, _content(msg.get("content"), f"{where}.content", images)))
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

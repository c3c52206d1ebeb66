"""Per-request size limits: what one request may carry, checked at Admit before any work.

Stage keys (all optional, integers): `maxPromptBytes` (text or chat content, in UTF-8 bytes; 0,
the default, is maxSeq x PROMPT_BYTES_PER_TOKEN), `maxStopStrings`, `maxStopBytes` (summed over
the stop strings), `maxLogitBias` (entries), `maxMessages` (chat turns), `maxMediaParts`,
`maxMediaBytes` (one item's encoded bytes, refused before anything decodes it),
`maxImagePixels` (one decoded image's width x height), `maxRequestIdBytes`, `maxGrammarBytes`
(the structured output's schema, regex or grammar text, or its choices summed, refused before
anything compiles it). A prompt over its
byte limit or a request id over its length is malformed (INVALID_ARGUMENT) and is refused
before tokenizing; the other limits are refusals (admitted=false with a reason), like a
sampling value out of range.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.stage.request import StageRequest
from llm_runner_svc.stage.runner_keys import ConfigError

# A token of any supported tokenizer stands for far fewer bytes than this on real text, so a
# prompt longer than maxSeq x 32 bytes cannot fit and is refused without being tokenized.
PROMPT_BYTES_PER_TOKEN = 32

# stage key -> (field, smallest allowed value)
KEYS: dict[str, tuple[str, int]] = {
    "maxPromptBytes": ("max_prompt_bytes", 0),
    "maxStopStrings": ("max_stop_strings", 0),
    "maxStopBytes": ("max_stop_bytes", 0),
    "maxLogitBias": ("max_logit_bias", 0),
    "maxMessages": ("max_messages", 1),
    "maxMediaParts": ("max_media_parts", 0),
    "maxMediaBytes": ("max_media_bytes", 1),
    "maxImagePixels": ("max_image_pixels", 1),
    "maxRequestIdBytes": ("max_request_id_bytes", 1),
    "maxGrammarBytes": ("max_grammar_bytes", 1),
}


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_bytes: int = 0  # 0 = maxSeq x PROMPT_BYTES_PER_TOKEN
    max_stop_strings: int = 32
    max_stop_bytes: int = 4096
    max_logit_bias: int = 1024
    max_messages: int = 256
    max_media_parts: int = 16
    max_request_id_bytes: int = 256
    max_media_bytes: int = 8 << 20
    max_image_pixels: int = 4096 * 4096
    max_grammar_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for key, (name, low) in KEYS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{key}: must be an integer >= {low}, got {value!r}")

    def prompt_bytes(self, max_seq: int) -> int:
        """The prompt byte limit in force on a stage whose maxSeq is `max_seq`."""
        return self.max_prompt_bytes or max_seq * PROMPT_BYTES_PER_TOKEN


@dataclass(frozen=True)
class RequestSizes:
    """How many items a request carries, read off the wire message in O(1) before it is
    converted (converting 300,000 stop strings or 2,000,000 token ids takes 0.1-0.3 s)."""

    num_stop: int = 0
    num_logit_bias: int = 0
    num_messages: int = 0
    num_token_ids: int = 0
    num_media: int = 0
    media_bytes: tuple[int, ...] = ()  # each media item's encoded size

    @classmethod
    def of(cls, req: StageRequest) -> RequestSizes:
        return cls(len(req.stop), len(req.logit_bias),
                   len(req.messages) if req.messages is not None else 0,
                   len(req.token_ids) if req.token_ids is not None else 0, req.num_media,
                   tuple(len(m.data) for m in req.media))


def parse_limits(raw: Mapping[str, Any]) -> RequestLimits:
    """The limits named in one stage's entry of the deployment file (others keep defaults)."""
    values: dict[str, Any] = {name: raw[key] for key, (name, _) in KEYS.items() if key in raw}
    return RequestLimits(**values)


def check_malformed(limits: RequestLimits, max_seq: int, req: StageRequest) -> None:
    """Sizes no stage would take: INVALID_ARGUMENT, before anything is tokenized."""
    limit = limits.prompt_bytes(max_seq)
    if req.text is not None:
        size = len(req.text.encode())
        if size > limit:
            raise InvalidArgument(f"prompt text has {size} bytes; the limit is {limit} "
                                  "(maxPromptBytes)")
    if req.messages is not None:
        size = sum(m.num_bytes for m in req.messages[:limits.max_messages + 1])
        if size > limit:
            raise InvalidArgument(f"chat messages hold {size} bytes of content; the limit is "
                                  f"{limit} (maxPromptBytes)")
    size = len(req.request_id.encode())
    if size > limits.max_request_id_bytes:
        raise InvalidArgument(f"request_id has {size} bytes; the limit is "
                              f"{limits.max_request_id_bytes} (maxRequestIdBytes)")

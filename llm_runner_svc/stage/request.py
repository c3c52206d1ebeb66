"""What a caller asks of the LLM stage, as a domain type.

Construction rejects malformed requests (INVALID_ARGUMENT): no prompt or two, NaN or infinite
numbers, negative ids, empty stop strings, a structured output with nothing in it (an empty
schema, regex or grammar, no choices; see Constraint). Well-formed values that this stage
cannot serve (a long prompt, top_p 1.5, a penalty of 5, a regex that does not compile, an
unknown adapter) are not errors here; admission refuses them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.runtime.constraint import Constraint

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
PORTS = ("text", "tokens", "hidden")
# The sampling values a NaN or an infinity makes malformed; a finite one out of its range is
# refused at admission instead.
SAMPLING_FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_p")


@dataclass(frozen=True)
class ChatPart:
    """A piece of a chat message: text, or the image `image` (an index into the media)."""

    text: str | None = None
    image: int | None = None


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    parts: tuple[ChatPart, ...] = ()  # the content as parts (then `content` is unused)

    def template_content(self) -> str | list[dict[str, str]]:
        """What the chat template sees: the text, or the parts as transformers writes them
        ({"type": "text", "text": ...} and {"type": "image"})."""
        if not self.parts:
            return self.content
        return [{"type": "image"} if p.image is not None else {"type": "text", "text": p.text or ""}
                for p in self.parts]

    @property
    def num_bytes(self) -> int:
        return len(self.content.encode()) + sum(len((p.text or "").encode()) for p in self.parts)


@dataclass(frozen=True)
class MediaItem:
    """An encoded media item as the caller sent it."""

    mime_type: str
    data: bytes


@dataclass(frozen=True)
class StageRequest:
    request_id: str
    text: str | None = None
    messages: tuple[ChatTurn, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    lora: str = ""
    ports: tuple[str, ...] = ()
    media: tuple[MediaItem, ...] = ()
    ignore_eos: bool = False
    disable_spec_decode: bool = False  # decode plainly on a speculative stage
    cache_lookup: bool = True  # reuse a cached prefix (context_cache_lookup_policy)
    cache_generated: bool = True  # commit generated tokens too (context_cache_commit_policy)
    presence_penalty: float | None = None  # None: the default (off) for each of these four
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logprobs: int | None = None  # None: none; 0: each token's own; k: and the top k
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None  # structured output (None: free text)

    def __post_init__(self) -> None:
        given = [n for n in ("text", "messages", "token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise InvalidArgument("a request needs exactly one prompt: text, messages or "
                                  f"token_ids (got {len(given)})")
        if self.text is not None and not self.text:
            raise InvalidArgument("prompt text is empty")
        if self.messages is not None:
            if not self.messages:
                raise InvalidArgument("messages is empty: at least one message is required")
            for i, turn in enumerate(self.messages):
                if turn.role not in CHAT_ROLES:
                    raise InvalidArgument(f"messages[{i}].role {turn.role!r} is not one of "
                                          f"{sorted(CHAT_ROLES)}")
        if self.token_ids is not None:
            if not self.token_ids:
                raise InvalidArgument("token_ids is empty: at least one token is required")
            if min(self.token_ids) < 0:
                raise InvalidArgument("token_ids holds a negative id")
        for name in SAMPLING_FLOATS:
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InvalidArgument(f"sampling.{name} must be a finite number, got {value}")
        for tok, bias in self.logit_bias.items():
            if tok < 0:
                raise InvalidArgument(f"logit_bias key {tok} is negative; keys are token ids")
            if math.isnan(bias) or bias == math.inf:
                raise InvalidArgument(f"logit_bias for token {tok} is {bias}; it must be "
                                      "finite or -inf")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop strings must not be empty")
        for port in self.ports:
            if not port:
                raise InvalidArgument("ports holds an empty name")
        placed = [p.image for m in self.messages or () for p in m.parts if p.image is not None]
        for index in placed:
            if index >= len(self.media):
                raise InvalidArgument(f"a chat part names image {index}; the request carries "
                                      f"{len(self.media)} media items")
        if len(set(placed)) != len(placed):
            raise InvalidArgument("a chat conversation places one image twice")

    @property
    def num_media(self) -> int:
        return len(self.media)

    def image_order(self) -> list[int]:
        """The media items in the order the prompt places them: as the chat parts name
        them, else in the order given."""
        placed = [p.image for m in self.messages or () for p in m.parts if p.image is not None]
        return placed if placed else list(range(len(self.media)))

    @property
    def grammar_bytes(self) -> int:
        """The size of the structured output's schema, regex, grammar or choices (UTF-8)."""
        c = self.constraint
        if c is None:
            return 0
        values = (c.value,) if isinstance(c.value, str) else c.value
        return sum(len(v.encode()) for v in values)

    @property
    def wants_hidden(self) -> bool:
        return "hidden" in self.ports

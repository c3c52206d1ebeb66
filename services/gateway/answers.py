"""One choice of an answer: a whole generation -> its choice object (`whole_choice`), or a
stream's pieces -> its chunks' choice objects (`ChoiceStream`). Both add what the request
asked beyond the text: log-probabilities (logprobs.py), a completion's echoed prompt, tool
calls (tools.py, tool_stream.py).

Finish reasons: our end_of_sequence and stop_words are OpenAI's "stop", max_length its
"length"; a request cancelled on the server side (the orchestrator's Cancel) ends "cancelled";
a choice that made tool calls and stopped is "tool_calls". Each choice also carries
`stop_reason`, our own name of why it ended.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from services.gateway.call import Call
from services.gateway.logprobs import (
    CompletionLogprobs,
    Position,
    chat_content,
    ids_of,
    prompt_positions,
)
from services.gateway.tool_stream import ToolStream, calls_of
from services.gateway.upstream import Outcome, Piece, TokenLogprob

_FINISH = {"end_of_sequence": "stop", "stop_words": "stop", "max_length": "length",
           "cancelled": "cancelled", "error": "error"}
# token ids -> the text of each on its own (Upstream.token_texts for the request's model)
TokenTexts = Callable[[Iterable[int]], Awaitable[dict[int, str]]]


@dataclass
class Generation:
    """One choice's whole Generate stream."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    outcome: Outcome | None = None


@dataclass(frozen=True)
class Prompt:
    """What an echo shows of a completion's prompt: its text, and the id of its first token
    (None when no log-probabilities are asked for)."""

    text: str = ""
    first_id: int | None = None


def finish_reason(outcome: Outcome, has_tool_calls: bool = False) -> dict[str, Any]:
    name = _FINISH[outcome.finish_reason]
    if has_tool_calls and name == "stop":
        name = "tool_calls"
    return {"finish_reason": name, "stop_reason": outcome.finish_reason}


async def whole_choice(call: Call, index: int, gen: Generation, prompt: Prompt,
                       texts: TokenTexts) -> dict[str, Any]:
    """The non-streaming choice `index` of generation `gen`."""
    assert gen.outcome is not None
    choice: dict[str, Any] = {"index": index}
    calls = calls_of(call.tools, gen.text) if call.tools is not None else None
    if call.kind == "chat":
        choice["message"] = {"role": "assistant", "content": gen.text} if not calls else {
            "role": "assistant", "content": None,
            "tool_calls": [c.to_json() for c in calls]}
        choice["logprobs"] = None if call.logprobs is None else {
            "content": chat_content(gen.logprobs, await texts(ids_of(gen.logprobs)))}
    else:
        choice["text"] = (prompt.text if call.echo else "") + gen.text
        positions = _positions(call, prompt, gen.prompt_logprobs, gen.logprobs)
        choice["logprobs"] = None if call.logprobs is None else CompletionLogprobs().shape(
            positions, await texts(ids_of(positions)))
    return {**choice, **finish_reason(gen.outcome, bool(calls))}


def _positions(call: Call, prompt: Prompt, prompt_lps: Iterable[TokenLogprob],
               lps: Iterable[TokenLogprob]) -> list[Position]:
    out = []
    if call.echo and prompt.first_id is not None:
        out = prompt_positions(prompt.first_id, tuple(prompt_lps))
    return out + [Position.of(lp) for lp in lps]


class ChoiceStream:
    """Choice `index`'s chunks: `piece` for each Piece, `end` with the Outcome; each returns
    the choice objects of the chunks to send (none while a tool call's text is held)."""

    def __init__(self, call: Call, index: int, prompt: Prompt, texts: TokenTexts) -> None:
        self.call, self.index, self.prompt, self.texts = call, index, prompt, texts
        self.is_first = True
        self.tools = ToolStream(call.tools) if call.tools is not None else None
        self.completion_logprobs = CompletionLogprobs()

    async def piece(self, piece: Piece) -> list[dict[str, Any]]:
        if self.call.kind == "chat":
            deltas: list[dict[str, Any]] = (self.tools.feed(piece.text) if self.tools
                                            else [{"content": piece.text}])
            logprobs = None
            if self.call.logprobs is not None:
                logprobs = {"content": chat_content(
                    piece.logprobs, await self.texts(ids_of(piece.logprobs)))}
                if not deltas:  # the text is held: the log-probabilities go now
                    deltas = [{}]
            return [self._chat(delta, logprobs if i == 0 else None)
                    for i, delta in enumerate(deltas)]
        is_first, self.is_first = self.is_first, False
        text = (self.prompt.text if self.call.echo and is_first else "") + piece.text
        choice: dict[str, Any] = {"index": self.index, "text": text, "logprobs": None}
        if self.call.logprobs is not None:
            positions = _positions(self.call, self.prompt if is_first else Prompt(),
                                   piece.prompt_logprobs, piece.logprobs)
            choice["logprobs"] = self.completion_logprobs.shape(
                positions, await self.texts(ids_of(positions)))
        return [{**choice, "finish_reason": None}]

    async def end(self, outcome: Outcome) -> list[dict[str, Any]]:
        has_calls = False
        out = []
        if self.call.kind == "chat":
            deltas: list[dict[str, Any]] = []
            if self.tools is not None:
                deltas, has_calls = self.tools.end()
            out = [self._chat(delta, None) for delta in deltas]
            if self.is_first:  # no text at all: still name the role
                out.append(self._chat({"content": ""}, None))
            last: dict[str, Any] = {"index": self.index, "delta": {}, "logprobs": None}
        else:
            if self.is_first and self.call.echo:  # nothing generated: the prompt still
                out = await self.piece(Piece("", 0))
            last = {"index": self.index, "text": "", "logprobs": None}
        return [*out, {**last, **finish_reason(outcome, has_calls)}]

    def _chat(self, delta: dict[str, Any], logprobs: dict[str, Any] | None) -> dict[str, Any]:
        if self.is_first:
            delta = {"role": "assistant", **delta}
            self.is_first = False
        return {"index": self.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": None}

"""OpenAI-shaped JSON: whole answers, stream chunks, error bodies, and the HTTP status of
every typed error.

Finish reasons: our end_of_sequence and stop_words are OpenAI's "stop", max_length its
"length"; a request cancelled on the server side (the orchestrator's Cancel) ends "cancelled".
Each choice also carries `stop_reason`, our own name of why it ended. A request that failed on
a stage (finish reason error) is not a bug of the gateway's: 502 with the stage's message.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from services.errors import ServiceError
from services.gateway.upstream import Outcome

_FINISH = {"end_of_sequence": "stop", "stop_words": "stop", "max_length": "length",
           "cancelled": "cancelled", "error": "error"}
# gRPC status name -> (HTTP status, OpenAI error type).
_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "invalid_request_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNIMPLEMENTED": (501, "not_implemented_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}
_INTERNAL = (500, "server_error")
GENERATION_FAILED = 502


def http_status(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of an error; anything but a ServiceError of a
    mapped status (a bug) is 500."""
    if isinstance(exc, ServiceError):
        return _STATUS.get(exc.code, _INTERNAL)
    return _INTERNAL


def error_body(message: str, kind: str, code: str | None, param: str | None = None
               ) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}}, as OpenAI's API answers."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_for(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and body of a raised error; `code` is the gRPC status name in lower
    case ("model_not_found" for an unknown model)."""
    status, kind = http_status(exc)
    if not isinstance(exc, ServiceError):
        return status, error_body(f"internal error: {type(exc).__name__}", kind, "internal")
    code = exc.code.lower()
    if status == 404 and exc.message.startswith("model "):
        code = "model_not_found"
    return status, error_body(exc.message, kind, code, getattr(exc, "param", None))


def failed_generation(outcome: Outcome) -> dict[str, Any]:
    """The body of a request a stage failed (finish reason error)."""
    return error_body(outcome.error or "generation failed on a stage", "server_error",
                      "generation_failed")


def usage(*outcomes: Outcome) -> dict[str, int]:
    """The usage of one or several generations. A generation that ended on its end-of-sequence
    token generated that token too: it counts among the completion tokens, as vLLM and OpenAI
    count it (the stage reports the tokens it delivered, which leave it out)."""
    prompt = sum(o.prompt_tokens for o in outcomes)
    completion = sum(o.completion_tokens + (o.finish_reason == "end_of_sequence")
                     for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@dataclass(frozen=True)
class Shaper:
    """The answers of one request: `kind` "chat" or "completion"."""

    kind: str
    request_id: str
    model: str
    created: int

    @classmethod
    def create(cls, kind: str, request_id: str, model: str) -> Shaper:
        return cls(kind, request_id, model, int(time.time()))

    def _head(self, suffix: str = "") -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.request_id, "object": obj + suffix, "created": self.created,
                "model": self.model}

    def whole(self, text: str, outcome: Outcome) -> dict[str, Any]:
        """The non-streaming answer."""
        return self.batch([(text, outcome)])

    def batch(self, answers: list[tuple[str, Outcome]]) -> dict[str, Any]:
        """The non-streaming answer of one or several generations: choice i is answers[i]."""
        choices = []
        for i, (text, outcome) in enumerate(answers):
            choice: dict[str, Any] = {"index": i}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice.update(logprobs=None, finish_reason=_FINISH[outcome.finish_reason],
                          stop_reason=outcome.finish_reason)
            choices.append(choice)
        return {**self._head(), "choices": choices,
                "usage": usage(*(outcome for _, outcome in answers))}

    def chunk(self, text: str, *, is_first: bool = False) -> bytes:
        """One server-sent event with new text (the first chat chunk names the role)."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if is_first else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=None)
        return event({**self._head(".chunk" if self.kind == "chat" else ""),
                      "choices": [choice]})

    def last_chunk(self, outcome: Outcome) -> bytes:
        """The event carrying the finish reason (no new text)."""
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = {}
        else:
            choice["text"] = ""
        choice.update(logprobs=None, finish_reason=_FINISH[outcome.finish_reason],
                      stop_reason=outcome.finish_reason)
        return event({**self._head(".chunk" if self.kind == "chat" else ""),
                      "choices": [choice]})

    def usage_chunk(self, outcome: Outcome) -> bytes:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        return event({**self._head(".chunk" if self.kind == "chat" else ""), "choices": [],
                      "usage": usage(outcome)})


def event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"

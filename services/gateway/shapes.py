"""OpenAI-shaped JSON: whole answers and stream chunks around their choices (answers.py),
the usage, error bodies, and the HTTP status of every typed error. A request that failed on a
stage (finish reason error) is not a bug of the gateway's: 502 with the stage's message.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.errors import ServiceError
from services.gateway.upstream import Outcome

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


def usage(outcomes: Sequence[Outcome], n: int = 1) -> dict[str, int]:
    """The usage of the generations of one request: n choices per prompt, in prompt order
    (the prompt counts once, as OpenAI counts it). A generation that ended on its
    end-of-sequence token generated that token too: it counts among the completion tokens, as
    vLLM and OpenAI count it (the stage reports the tokens it delivered, which leave it
    out)."""
    prompt = sum(o.prompt_tokens for o in outcomes[::n])
    completion = sum(o.completion_tokens + (o.finish_reason == "end_of_sequence")
                     for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@dataclass(frozen=True)
class Shaper:
    """The answers of one request: `kind` "chat" or "completion"; the choices themselves are
    answers.py's."""

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

    def whole(self, choices: list[dict[str, Any]], outcomes: Sequence[Outcome], n: int
              ) -> dict[str, Any]:
        """The non-streaming answer."""
        return {**self._head(), "choices": choices, "usage": usage(outcomes, n)}

    def chunk(self, choices: list[dict[str, Any]]) -> bytes:
        """One server-sent event carrying `choices` (each naming its index)."""
        return event({**self._head(".chunk" if self.kind == "chat" else ""),
                      "choices": choices})

    def usage_chunk(self, outcomes: Sequence[Outcome], n: int) -> bytes:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        return event({**self._head(".chunk" if self.kind == "chat" else ""), "choices": [],
                      "usage": usage(outcomes, n)})


def event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"

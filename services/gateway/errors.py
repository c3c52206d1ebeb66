"""The gateway's one error of its own: a field of the request body it refuses."""

from __future__ import annotations

from services.errors import InvalidArgument


class BadField(InvalidArgument):
    """A malformed or unsupported field; `param` names it as OpenAI's error bodies do."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

"""Chat templates (Jinja, as shipped inside GGUF files and tokenizer_config.json)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llm_runner_svc.errors import InvalidArgument

_ROLES = ("system", "user", "assistant", "tool")


def _raise(message: str) -> None:
    raise InvalidArgument(f"chat template: {message}")


class ChatTemplate:
    """A compiled template; `render` gives the prompt text for a list of messages."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.source = source
        self._template = env.from_string(source)
        self._bos = bos_token
        self._eos = eos_token

    def render(self, messages: Sequence[Mapping[str, Any]],
               add_generation_prompt: bool = True) -> str:
        if not messages:
            raise InvalidArgument("messages: at least one message is required")
        for i, m in enumerate(messages):
            if m.get("role") not in _ROLES:
                raise InvalidArgument(
                    f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {m.get('role')!r}")
            content = m.get("content")
            if not isinstance(content, str) and not (isinstance(content, list) and all(
                    isinstance(p, dict) and p.get("type") in ("text", "image")
                    for p in content)):
                raise InvalidArgument(f"messages[{i}].content must be a string or a list of "
                                      "text and image parts")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=self._bos, eos_token=self._eos)
        except TemplateError as exc:
            raise InvalidArgument(f"chat template failed: {exc}") from exc

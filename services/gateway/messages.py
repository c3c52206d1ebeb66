"""A chat body's `messages` -> (role, content) turns for the stage's chat template: text, or
text and images (base64 data: URLs only; the gateway fetches nothing)."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from services.gateway.errors import BadField
from services.gateway.tools import calls_text

# OpenAI's roles; "developer" is its newer name for "system". The stage's template gets "tool"
# turns as they are.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}
# (role, content), oldest first; content with images is parts: text (str) and images (int, an
# index into the request's images)
Messages = tuple[tuple[str, str | tuple[str | int, ...]], ...]


def messages_of(value: Any, images: list[tuple[str, bytes]]) -> Messages:
    """A chat body's `messages` as (role, content) pairs, each image appended to `images`.
    An assistant turn's `tool_calls` become its text (tools.calls_text); a "tool" turn keeps
    its role and content (its tool_call_id has no place in a template's turn)."""
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
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""  # OpenAI's shape of an assistant turn that only called tools
        parsed = _content(content, f"{where}.content", images)
        if role == "assistant" and msg.get("tool_calls") not in (None, []):
            if not isinstance(parsed, str):
                raise BadField(f"{where}.content", f"{where}.content: an assistant turn "
                               "with tool_calls has text content only")
            calls = calls_text(msg["tool_calls"], f"{where}.tool_calls")
            parsed = f"{parsed}\n{calls}" if parsed else calls
        out.append((role, parsed))
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

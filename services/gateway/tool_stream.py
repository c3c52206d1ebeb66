"""A chat stream's text as tool-call deltas, in OpenAI's shape: a call's first delta carries
`index`, `id`, `type` and `function.name`, later ones `function.arguments` fragments.

- named: the output is the arguments; each piece of text is the next fragment, as it comes.
- required: the output is an array of calls; each call is sent whole once its object closes
  (its name is only known from it, and it is checked against the tools before it is sent).
  An output that holds no call (cut short by max_tokens) ends as content.
- auto: text is held while it may still be a call (it starts with `{`, `[`, ``` or `<`);
  text that cannot be one streams as content from then on; held text is a call or content
  at the end (tools.parse_calls).
"""

from __future__ import annotations

from typing import Any

from services.gateway.tools import ToolCall, ToolPlan, parse_calls

_CALL_STARTS = "{[`<"


class ToolStream:
    """One choice's deltas; `feed` each piece of text, then `end` once."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # everything fed
        self.calls: list[ToolCall] = []  # required: the calls whose objects closed
        self._is_content = False  # auto: the text is not a call
        self._scanned = 0  # required: how far the text is scanned
        self._depth = 0
        self._start = 0  # required: where the open call's object starts
        self._in_string = False
        self._is_escaped = False
        self._named: ToolCall | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        if self.plan.mode == "named":
            if self._named is None:
                self._named = ToolCall.create(self.plan.name, "")
                return [_call_delta(0, self._named, text)]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] \
                if text else []
        if self.plan.mode == "required":
            done = len(self.calls)
            self._scan()
            return [_call_delta(done + i, c, c.arguments)
                    for i, c in enumerate(self.calls[done:])]
        if self._is_content:
            return [{"content": text}] if text else []
        held = self.text.lstrip()
        if held and held[0] not in _CALL_STARTS:
            self._is_content = True
            return [{"content": self.text}]
        return []

    def end(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas, and whether the choice made tool calls."""
        if self.plan.mode == "named":
            if self._named is None:
                return [_call_delta(0, ToolCall.create(self.plan.name, ""), "")], True
            return [], True
        if self.calls:
            return [], True
        if self.plan.mode == "auto" and not self._is_content:
            calls = parse_calls(self.plan, self.text)
            if calls:
                return [_call_delta(i, c, c.arguments) for i, c in enumerate(calls)], True
        if self._is_content or not self.text:
            return [], False
        return [{"content": self.text}], False

    def _scan(self) -> None:
        """Adds the calls whose objects closed since the last scan (the top-level array's
        items) to `calls`."""
        for i in range(self._scanned, len(self.text)):
            ch = self.text[i]
            if self._in_string:
                if self._is_escaped:
                    self._is_escaped = False
                elif ch == "\\":
                    self._is_escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._start = i
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1:
                    self.calls.extend(parse_calls(self.plan, self.text[self._start:i + 1])
                                      or ())
        self._scanned = len(self.text)


def calls_of(plan: ToolPlan, text: str) -> list[ToolCall] | None:
    """The tool calls of a whole output, as its stream would have sent them: a required
    array's complete calls even when max_tokens cut it short."""
    if plan.mode != "required":
        return parse_calls(plan, text)
    stream = ToolStream(plan)
    stream.feed(text)
    return stream.calls or None


def _call_delta(index: int, call: ToolCall, arguments: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": arguments}}]}

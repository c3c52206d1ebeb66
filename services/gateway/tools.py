"""Tool calls: OpenAI's `tools` and `tool_choice` -> a `ToolPlan`, and the model's output ->
tool calls.

The stage renders a conversation with the model's chat template from roles and text only (the
contract carries no `tools` for the template), so the gateway tells the model about the tools
itself: a system message lists them (name, description, parameters schema) and the answer's
format. What `tool_choice` asks:

- "none" (or no tools): an ordinary generation; the tools are not described.
- a named function: the output is constrained to that function's parameters schema and is
  its call's `arguments`.
- "required": the output is constrained to a JSON array of one or more calls, each
  {"name": <a tool>, "arguments": <that tool's parameters>} (an anyOf of one object schema
  per tool, so the arguments validate against the tool they name); one call at most when
  `parallel_tool_calls` is false.
- "auto" (the default with tools): unconstrained; an output that is a call of a known tool,
  {"name", "arguments"} or an array of them (alone, or in a ```json fence or <tool_call>
  tags), is returned as tool calls, anything else as content.

Earlier turns: an assistant message's `tool_calls` become its text in that same format, a
"tool" message goes to the template as the role "tool" with its content.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.gateway.constraints import Constraint, schema_text
from services.gateway.errors import BadField

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_EMPTY_PARAMETERS = '{"type":"object","properties":{}}'
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)
_TAGS = re.compile(r"^<tool_call>\s*(.*?)\s*</tool_call>$", re.S)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: str  # its JSON Schema as JSON text


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses its tools: `mode` "named" (`name` is the function), "required"
    or "auto"."""

    mode: str
    tools: tuple[Tool, ...]
    name: str = ""
    is_parallel: bool = True

    def constraint(self) -> Constraint | None:
        """The output's constraint: the named tool's parameters, or the array of calls."""
        if self.mode == "named":
            return Constraint("json_schema", self.tool(self.name).parameters, "tool_choice")
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        calls = [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.name]},
            "arguments": _hoist(json.loads(t.parameters), t.name, defs)},
            "required": ["name", "arguments"], "additionalProperties": False}
            for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if defs:
            schema["$defs"] = defs
        if not self.is_parallel:
            schema["maxItems"] = 1
        return Constraint("json_schema", json.dumps(schema, separators=(",", ":")),
                          "tool_choice")

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)

    def prompt(self) -> str:
        """The system text that describes the tools and how to call them."""
        listed = json.dumps([{"name": t.name, "description": t.description,
                              "parameters": json.loads(t.parameters)} for t in self.tools])
        if self.mode == "named":
            how = (f"Call the function {self.name}: answer with only its arguments, one JSON "
                   "object that matches its parameters.")
        else:
            how = ('To call a function, answer with only a JSON object {"name": <the '
                   'function\'s name>, "arguments": <an object matching its parameters>}'
                   + (", or a JSON array of such objects to call several" if self.is_parallel
                      else "") + ".")
            if self.mode == "auto":
                how += " To answer without calling a function, answer in plain text."
        return f"You can call these functions:\n{listed}\n{how}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    @classmethod
    def create(cls, name: str, arguments: str) -> ToolCall:
        return cls("call_" + uuid.uuid4().hex[:24], name, arguments)

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        head = {} if index is None else {"index": index}
        return {**head, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _hoist(parameters: Any, tool: str, defs: dict[str, Any]) -> Any:
    """A tool's parameters schema placed inside another: its definitions ($defs, or the
    older definitions) move to `defs` under names prefixed with the tool's, and its local
    references follow them (a "#/$defs/..." reference is resolved from the document's root,
    which is no longer the tool's schema)."""
    if not isinstance(parameters, dict):
        return parameters
    local = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    if not local:
        return parameters
    renamed = {f"#/{where}/{key}": f"#/$defs/{tool}.{key}"
               for where in ("$defs", "definitions") for key in local}

    def fix(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (renamed.get(v, v) if k == "$ref" and isinstance(v, str) else fix(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [fix(item) for item in node]
        return node

    defs.update({f"{tool}.{key}": fix(value) for key, value in local.items()})
    return fix({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")})


def tool_plan_of(body: dict[str, Any]) -> ToolPlan | None:
    """The body's ToolPlan, or None for an ordinary generation."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadField("parallel_tool_calls", "parallel_tool_calls must be true or false")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise BadField("tool_choice", "tool_choice asks for a tool call but tools is empty")
    plan = ToolPlan("auto", tools, is_parallel=parallel is not False)
    if choice in ("auto", "required"):
        return ToolPlan(choice, tools, is_parallel=plan.is_parallel)
    name = (choice.get("function") or {}).get("name") if (
        isinstance(choice, dict) and choice.get("type") == "function") else None
    if not isinstance(name, str):
        raise BadField("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                       '{"type": "function", "function": {"name": ...}}')
    if name not in {t.name for t in tools}:
        raise BadField("tool_choice", f"tool_choice names {name!r}, which is not among tools")
    return ToolPlan("named", tools, name=name, is_parallel=False)


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise BadField("tools", "tools must be a list of functions")
    out: list[Tool] = []
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict) or item.get("type") != "function":
            raise BadField("tools", f'{where} must be {{"type": "function", "function": '
                           '{name, description?, parameters?}}')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BadField("tools", f"{where}.function.name must be 1 to 64 letters, digits, "
                           "_ . or -")
        if any(t.name == name for t in out):
            raise BadField("tools", f"{where}: a second function named {name!r}")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise BadField("tools", f"{where}.function.description must be a string")
        parameters = function.get("parameters")
        out.append(Tool(name, description, _EMPTY_PARAMETERS if parameters is None else
                        schema_text(parameters, f"{where}.function.parameters")))
    return tuple(out)


def calls_text(value: Any, where: str) -> str:
    """An earlier assistant turn's `tool_calls` as the text the model is asked to write."""
    if not isinstance(value, list):
        raise BadField(where, f"{where} must be a list")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", "{}"), str)):
            raise BadField(where, f'{where}[{i}] must be {{"type": "function", "function": '
                           '{"name": ..., "arguments": <JSON text>}}')
        arguments: Any = function.get("arguments", "{}")
        with contextlib.suppress(json.JSONDecodeError):  # else kept as the text it is
            arguments = json.loads(arguments)
        calls.append({"name": function["name"], "arguments": arguments})
    return json.dumps(calls[0] if len(calls) == 1 else calls)


def parse_calls(plan: ToolPlan, text: str) -> list[ToolCall] | None:
    """The tool calls `text` holds under `plan`, or None when it is content (auto) or does not
    parse (a required array cut short). A named call's arguments are the text as written."""
    if plan.mode == "named":
        return [ToolCall.create(plan.name, text)]
    body = text.strip()
    for pattern in (_FENCE, _TAGS):
        match = pattern.match(body)
        if match is not None:
            body = match.group(1)
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    names = {t.name for t in plan.tools}
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        arguments = item.get("arguments", item.get("parameters"))
        if item.get("name") not in names or not isinstance(arguments, dict):
            return None
        calls.append(ToolCall.create(item["name"], json.dumps(arguments)))
    if not calls or (len(calls) > 1 and not plan.is_parallel):
        return None
    return calls

"""Tool calls: ``tools`` with ``tool_choice`` naming a function, or ``"required"``.

A tool call is a constraint: the output is JSON under the named function's ``parameters``
schema (its arguments), or, under ``"required"``, an object ``{"name": ..., "arguments": ...}``
for one of the tools, each name with its own schema. It runs on the same constraint path and
default twist as ``response_format``, so every call's arguments parse and validate. The answer
carries it in OpenAI's form (``tool_calls``, ``finish_reason`` ``"tool_calls"``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..potentials.spec import ConstraintSpec
from .errors import APIError, invalid

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """The call a request asks for.

    Attributes:
        named: the function ``tool_choice`` names; None: any of the tools (``"required"``).
        spec: the constraint the output is generated under.
    """

    named: str | None
    spec: ConstraintSpec

    def call(self, text: str, call_id: str) -> dict | None:
        """The tool call (OpenAI's form) an output makes; None where it is not whole JSON (cut short)."""
        if self.named is not None:
            name, arguments = self.named, text
        else:
            try:
                made = json.loads(text)
            except ValueError:
                return None
            name, arguments = made["name"], json.dumps(made["arguments"], ensure_ascii=False)
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

    def answered(self, choice: dict, text: str, call_id: str) -> dict:
        """A chat choice whose output ``text`` is this call (one cut short of whole JSON keeps its text)."""
        call = self.call(text, call_id)
        if call is None:
            return choice
        reason = "tool_calls" if choice["finish_reason"] == "stop" else choice["finish_reason"]
        return choice | {
            "message": {"role": "assistant", "content": None, "tool_calls": [call]},
            "finish_reason": reason,
        }

    def delta(self, text: str, call_id: str, *, first: bool = False, whole: str | None = None) -> dict:
        """A streamed chunk's delta.

        A named call's arguments stream as they settle (its name in the first chunk); a call of
        ``"required"`` comes whole in the last chunk (``whole``: the output), once its name is known.
        """
        if first:
            head = {"id": call_id, "type": "function", "function": {"name": self.named, "arguments": ""}}
            return {"role": "assistant", "content": None} | (
                {"tool_calls": [{"index": 0} | head]} if self.named else {}
            )
        if self.named is not None:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        call = None if whole is None else self.call(whole, call_id)
        return {} if call is None else {"tool_calls": [{"index": 0} | call]}


def tool_choice(body: dict) -> ToolChoice | None:
    """The call ``tools`` and ``tool_choice`` ask for; None where none is (400: what is not built)."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if body.get("parallel_tool_calls"):
        raise invalid("parallel_tool_calls is not supported: one tool call per answer", "parallel_tool_calls")
    if choice in (None, "none") and not tools or choice == "none":
        return None
    schemas = _schemas(tools)
    if choice in (None, "auto"):
        raise invalid(
            'tool_choice "auto" (the default with tools) is not supported: it needs the model\'s own '
            'tool-call format parsed, which this server does not do; name a function or use "required"',
            "tool_choice",
        )
    if choice == "required":
        return ToolChoice(None, _spec({"anyOf": [_call_schema(n, s) for n, s in schemas.items()]}))
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in schemas:
        raise invalid(
            'tool_choice must be "none", "required" or {"type": "function", "function": {"name": ...}} '
            "naming one of the tools",
            "tool_choice",
        )
    return ToolChoice(name, _spec(schemas[name]))


def _schemas(tools) -> dict[str, dict]:
    """Each function tool's name and parameters schema."""
    if not isinstance(tools, list) or not tools:
        raise invalid("tool_choice needs tools: a non-empty list of functions", "tools")
    out = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise invalid(
                'each tool must be {"type": "function", "function": {"name": ..., "parameters": ...}}',
                "tools",
            )
        out[function["name"]] = function.get("parameters") or NO_PARAMETERS
    return out


def _call_schema(name: str, parameters: dict) -> dict:
    """A call of function ``name``: its name, then its arguments."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _spec(schema: dict) -> ConstraintSpec:
    try:
        return ConstraintSpec("schema", json.dumps(schema))
    except ValueError as err:
        raise APIError(422, f"a tool's parameters: {err}", param="tools", code="invalid_schema") from None

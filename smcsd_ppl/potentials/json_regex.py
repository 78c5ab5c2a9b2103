"""A regular expression for JSON objects of a simple schema (fast constraints).

Covers what extraction tasks usually need: an object whose properties (all
required, in schema order) are strings (``enum``, ``maxLength``), integers,
numbers, booleans or null. Anything else raises ``ValueError``; for full JSON
Schema use genlm-control's ``JsonSchema`` through ``PotentialConstraint``.
"""

from __future__ import annotations

import json
import re

_WS = "[ ]?"
_STRING_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt])'
_SCALARS = {
    "integer": r"-?(0|[1-9][0-9]{0,15})",
    "number": r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,10})?",
    "boolean": "(true|false)",
    "null": "null",
}


def schema_to_regex(schema: dict) -> str:
    """Regex matching compact JSON objects valid under ``schema`` (see module doc)."""
    if schema.get("type") != "object" or "properties" not in schema:
        raise ValueError("only object schemas with 'properties' are supported")
    parts = []
    for name, prop in schema["properties"].items():
        parts.append(re.escape(json.dumps(name)) + _WS + ":" + _WS + _value(name, prop))
    return r"\{" + _WS + ("," + _WS).join(parts) + _WS + r"\}"


def _value(name: str, prop: dict) -> str:
    if "enum" in prop:
        return "(" + "|".join(re.escape(json.dumps(v)) for v in prop["enum"]) + ")"
    kind = prop.get("type")
    if kind == "string":
        high = prop.get("maxLength")
        low = prop.get("minLength", 0)
        count = f"{{{low},{high}}}" if high is not None else ("*" if low == 0 else f"{{{low},}}")
        return '"' + _STRING_CHAR + count + '"'
    if kind in _SCALARS:
        return _SCALARS[kind]
    raise ValueError(f"property {name!r}: unsupported schema {prop}")

"""A regular expression for JSON objects of a simple schema (fast constraints).

Covers what extraction tasks usually need: an object whose properties (all
required, in schema order) are strings (``enum``, ``maxLength``), integers,
numbers, booleans or null. Any other keyword raises ``ValueError`` (descriptive ones
such as ``title`` and ``description`` are ignored); for full JSON
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


# Keywords that only describe, or only make the schema looser than the regex (which requires
# every property, in order, and no others): dropping them can never let an invalid object through.
_ANNOTATIONS = {"title", "description", "examples", "default", "$comment", "$schema"}
_OBJECT_KEYS = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties"}
_PROPERTY_KEYS = {
    "string": _ANNOTATIONS | {"type", "enum", "const", "minLength", "maxLength"},
    **{kind: _ANNOTATIONS | {"type", "enum", "const"} for kind in _SCALARS},
    None: _ANNOTATIONS | {"enum", "const"},
}


def schema_to_regex(schema: dict) -> str:
    """Regex matching compact JSON objects valid under ``schema`` (see module doc)."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object (dict), got {schema!r}")
    if schema.get("type") != "object" or not isinstance(schema.get("properties"), dict):
        raise ValueError("only object schemas with 'properties' are supported")
    _check_keys("the schema", schema, _OBJECT_KEYS)
    parts = []
    for name, prop in schema["properties"].items():
        parts.append(re.escape(json.dumps(name)) + _WS + ":" + _WS + _value(name, prop))
    return r"\{" + _WS + ("," + _WS).join(parts) + _WS + r"\}"


def _check_keys(where: str, schema: dict, allowed: set[str]) -> None:
    unknown = sorted(set(schema) - allowed)
    if unknown:
        raise ValueError(
            f"{where}: unsupported keyword(s) {', '.join(unknown)}; schema_to_regex supports "
            f"{', '.join(sorted(allowed - _ANNOTATIONS))} here (genlm-control's JsonSchema covers the rest)"
        )


def _value(name: str, prop: dict) -> str:
    if not isinstance(prop, dict):
        raise ValueError(f"property {name!r}: expected a schema object (dict), got {prop!r}")
    kind = prop.get("type")
    if kind not in _PROPERTY_KEYS:
        raise ValueError(f"property {name!r}: unsupported schema {prop}")
    _check_keys(f"property {name!r}", prop, _PROPERTY_KEYS[kind])
    if "enum" in prop or "const" in prop:
        values = prop["enum"] if "enum" in prop else [prop["const"]]
        if not isinstance(values, list) or not values:
            raise ValueError(f"property {name!r}: enum must be a non-empty list, got {values!r}")
        return "(" + "|".join(re.escape(json.dumps(v)) for v in values) + ")"
    if kind == "string":
        low, high = prop.get("minLength", 0), prop.get("maxLength")
        for key, bound in (("minLength", low), ("maxLength", high)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
                raise ValueError(f"property {name!r}: {key} must be an integer >= 0, got {bound!r}")
        if high is not None and low > high:
            raise ValueError(f"property {name!r}: minLength ({low}) is greater than maxLength ({high})")
        count = f"{{{low},{high}}}" if high is not None else ("*" if low == 0 else f"{{{low},}}")
        return '"' + _STRING_CHAR + count + '"'
    if kind in _SCALARS:
        return _SCALARS[kind]
    raise ValueError(f"property {name!r}: unsupported schema {prop} (give a type, or an enum)")

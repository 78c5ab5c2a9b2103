"""JSON Schema input checks, and the grammar engine's errors as one line.

A schema is first checked against its meta-schema, so that a mistake such as
``{"type": "strin"}`` is named in JSON Schema's own terms (where, and what is wrong there)
rather than in the engine's grammar text. The engine ignores keywords it does not know, as
JSON Schema allows, so a misspelled ``maxLenght`` would silently constrain nothing:
``check_schema`` also names any keyword that is neither JSON Schema vocabulary nor an ``x-``
extension. Keywords that are vocabulary but not implemented (``not``, ``uniqueItems``,
``if``, ...) are named by the engine.
"""

from __future__ import annotations

import re

# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_ONE = {
    "items",
    "additionalItems",
    "additionalProperties",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
}
_LIST = {"allOf", "anyOf", "oneOf", "prefixItems"}
_MAP = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
# Every other keyword of JSON Schema (2020-12 and draft-07): values that are not schemas.
_OTHER = {
    "$schema",
    "$id",
    "$ref",
    "$anchor",
    "$dynamicRef",
    "$dynamicAnchor",
    "$vocabulary",
    "$comment",
    "type",
    "enum",
    "const",
    "multipleOf",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "maxItems",
    "minItems",
    "uniqueItems",
    "maxContains",
    "minContains",
    "maxProperties",
    "minProperties",
    "required",
    "dependentRequired",
    "dependencies",
    "format",
    "contentEncoding",
    "contentMediaType",
    "title",
    "description",
    "default",
    "deprecated",
    "readOnly",
    "writeOnly",
    "examples",
}
KEYWORDS = frozenset(_ONE | _LIST | _MAP | _OTHER)


def check_schema(schema) -> None:
    """Raise ``ValueError`` where ``schema`` breaks its meta-schema or uses a word outside its vocabulary."""
    check_meta_schema(schema)
    check_keywords(schema)


def check_meta_schema(schema) -> None:
    """Raise ``ValueError``, in one line, at the first place where ``schema`` breaks its meta-schema.

    The meta-schema is the one its ``$schema`` names (JSON Schema 2020-12 without one); the
    message gives the JSON pointer into ``schema`` and what is wrong there.
    """
    import jsonschema
    from jsonschema.exceptions import best_match

    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"JSON schema at #: expected an object (dict) or a boolean, got {schema!r}")
    meta = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = best_match(meta(meta.META_SCHEMA).iter_errors(schema))
    if error is None:
        return
    while error.context:  # anyOf, oneOf: the alternative that came closest says what to change
        error = best_match(error.context)
    where = "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in error.absolute_path)
    raise ValueError(f"JSON schema at #{where}: {' '.join(error.message.split())}")


def check_keywords(schema, where: str = "#") -> None:
    """Raise ``ValueError`` naming the first keyword that is not JSON Schema vocabulary."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"JSON schema at {where}: expected an object (dict) or a boolean, got {schema!r}")
    unknown = sorted(k for k in schema if k not in KEYWORDS and not k.startswith("x-"))
    if unknown:
        raise ValueError(
            f"JSON schema at {where}: unknown keyword(s) {', '.join(map(repr, unknown))} "
            "(a misspelling? prefix vendor extensions with 'x-')"
        )
    for key, value in schema.items():
        if key in _ONE and not isinstance(value, list):
            check_keywords(value, f"{where}/{key}")
        elif key in _LIST or (key in _ONE and isinstance(value, list)):  # draft-04 tuple `items`
            if not isinstance(value, list):
                raise ValueError(f"JSON schema at {where}/{key}: expected a list of schemas, got {value!r}")
            for i, sub in enumerate(value):
                check_keywords(sub, f"{where}/{key}/{i}")
        elif key in _MAP:
            if not isinstance(value, dict):
                raise ValueError(
                    f"JSON schema at {where}/{key}: expected an object of schemas, got {value!r}"
                )
            for name, sub in value.items():
                check_keywords(sub, f"{where}/{key}/{name}")


def engine_error(message: str) -> str:
    """The engine's (possibly multi-line) error as one line, naming what it could not do."""
    keys = re.search(r"Unimplemented keys: \[(.*?)\]", message)
    if keys:
        names = ", ".join(k.strip().strip('"') for k in keys.group(1).split(","))
        return f"unsupported JSON Schema keyword(s): {names} (see docs/constraints.md for what is covered)"
    detail = re.search(r"^error: (.+)$", message, re.MULTILINE)  # the regex parser's own words
    if detail:
        return detail.group(1).strip()
    first = message.strip().splitlines()[0] if message.strip() else ""  # then the engine's grammar
    first = re.sub(r"^at \d+\(\d+\): ", "", first)  # a place in that grammar, not in the user's text
    return re.sub(r"^failed to compile JSON schema: ", "", first).strip()

"""A constraint named by text: a JSON Schema, a regex or a Lark grammar, built against a tokenizer.

What the command line's ``--schema``, ``--regex`` and ``--grammar`` give, kept as plain text
so that a batch can record which constraint made its outputs (``digest``) before any
tokenizer is at hand.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from .schema import check_schema

CONSTRAINT_KINDS = ("schema", "regex", "grammar")


@dataclass(frozen=True)
class ConstraintSpec:
    """A constraint's kind (one of ``CONSTRAINT_KINDS``) and its text.

    Args:
        kind: ``"schema"`` (JSON Schema text), ``"regex"`` (a pattern) or ``"grammar"``
            (llguidance's Lark dialect, ``start`` its start rule).
        text: the schema's JSON, the pattern or the grammar.

    Raises:
        ValueError: an unknown kind, empty text, or a schema that is not a JSON object, breaks
            its meta-schema or uses a keyword outside JSON Schema's vocabulary.
    """

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(
                f"unknown constraint kind {self.kind!r}; choose from {', '.join(CONSTRAINT_KINDS)}"
            )
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError(f"the {self.kind} is empty")
        if self.kind == "schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as err:
                raise ValueError(f"the JSON schema is not valid JSON: {err}") from err
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
            check_schema(schema)  # here, so that a mistake is named before any model loads

    def build(self, tokenizer, eos_token_ids: Sequence[int]):
        """The ``GrammarConstraint`` of this text (``ValueError``: it does not compile)."""
        from .grammar import GrammarConstraint, JsonSchemaConstraint, RegexConstraint

        if self.kind == "schema":
            return JsonSchemaConstraint(self.text, tokenizer, eos_token_ids)
        if self.kind == "regex":
            return RegexConstraint(self.text, tokenizer, eos_token_ids)
        return GrammarConstraint(self.text, tokenizer, eos_token_ids)

    def digest(self) -> str:
        """A short hash of the kind and text (a schema's JSON layout aside)."""
        text = json.dumps(json.loads(self.text), sort_keys=True) if self.kind == "schema" else self.text
        return hashlib.sha256(json.dumps([self.kind, text]).encode()).hexdigest()[:16]

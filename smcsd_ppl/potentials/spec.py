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

from .lark import check_grammar, regex_grammar, schema_grammar
from .schema import check_keywords, check_meta_schema

CONSTRAINT_KINDS = ("schema", "regex", "grammar")


@dataclass(frozen=True)
class ConstraintSpec:
    """A constraint's kind (one of ``CONSTRAINT_KINDS``) and its text.

    Args:
        kind: ``"schema"`` (JSON Schema text), ``"regex"`` (a pattern) or ``"grammar"``
            (llguidance's Lark dialect, ``start`` its start rule).
        text: the schema's JSON, the pattern or the grammar.

    Raises:
        ValueError: an unknown kind, empty text, a schema that is not a JSON object, breaks
            its meta-schema or uses a keyword outside JSON Schema's vocabulary, or a constraint
            that does not compile or that no text satisfies.
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
            check_keywords(schema)
        try:  # here, with no model: a mistake is named before any loads
            check_grammar(self.grammar(), self.name)
        except ValueError as err:
            if self.kind == "schema" and "Unsatisfiable" not in str(err):
                check_meta_schema(schema)  # its message names the place, where it has one
            raise
        if self.kind == "schema":  # after: importing its checker takes seconds
            check_meta_schema(schema)

    @property
    def default_twist(self) -> str | None:
        """The built constraint's ``default_twist`` (a JSON schema's ``finite``), known before it is built."""
        from .grammar import JsonSchemaConstraint

        return JsonSchemaConstraint.default_twist if self.kind == "schema" else None

    @property
    def name(self) -> str:
        """How errors name it."""
        return {"schema": "JSON schema", "regex": f"regex {self.text!r}"}.get(self.kind, "grammar")

    def grammar(self) -> str:
        """Its Lark grammar (the one ``build`` compiles for a tokenizer)."""
        if self.kind == "schema":
            return schema_grammar(json.loads(self.text))
        return regex_grammar(self.text) if self.kind == "regex" else self.text

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

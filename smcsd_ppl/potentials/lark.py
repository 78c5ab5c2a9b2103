"""Constraints as text: the Lark grammar of a regex or a JSON Schema, checked with no tokenizer.

No torch and no model here: the command line and the server check a constraint's text with
these before anything loads; ``grammar`` compiles the same grammars for a tokenizer.
"""

from __future__ import annotations

import json

from .schema import engine_error

# Every tokenization of an output's text is allowed (the engine would otherwise force the
# canonical tokens of text the grammar fixes): masks then say exactly which token
# sequences spell a valid prefix, and a token consumed is a token the mask allowed.
EXACT = '%llguidance {"no_forcing": true}\n'


def regex_grammar(pattern: str) -> str:
    """The Lark grammar of the outputs that match ``pattern`` in full."""
    import llguidance

    if not isinstance(pattern, str):
        raise ValueError(f"a regex must be a string, got {type(pattern).__name__}")
    return f"start: /{llguidance.regex_to_lark(pattern)}/"


def schema_grammar(schema: dict | bool, separators: tuple[str, str] = (", ", ": ")) -> str:
    """The Lark grammar of the JSON texts valid under ``schema``, laid out with ``separators``."""
    layout = {"item_separator": separators[0], "key_separator": separators[1], "whitespace_flexible": False}
    if isinstance(schema, dict):  # the engine reads its options from the schema itself
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **layout}}
    return f"start: %json {json.dumps(schema)}"


def check_grammar(grammar: str, name: str = "grammar") -> None:
    """Refuse a grammar that does not compile or that no text satisfies, on its text alone.

    No tokenizer and no model: a mistake is named before any loads. (What a vocabulary cannot
    spell is found when the constraint is built for it.)
    """
    import llguidance

    compiled = llguidance.LLMatcher.grammar_from_lark(EXACT + grammar)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled)
    if is_error:
        raise ValueError(f"cannot compile {name}: {engine_error(messages[0])}")

"""Constraints and twists that enter SMC-SD weights (genlm-control potentials among them).

Names are imported when first used: ``potentials.spec`` checks a constraint's text before any
model (or torch) loads.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names, for type checkers and the API docs, without the import
    from .constraints import Constraint, PotentialConstraint, token_bytes
    from .grammar import GrammarConstraint, JsonSchemaConstraint, RegexConstraint

_WHERE = {
    "Constraint": "constraints",
    "PotentialConstraint": "constraints",
    "token_bytes": "constraints",
    "GrammarConstraint": "grammar",
    "JsonSchemaConstraint": "grammar",
    "RegexConstraint": "grammar",
}

__all__ = [
    "Constraint",
    "GrammarConstraint",
    "JsonSchemaConstraint",
    "PotentialConstraint",
    "RegexConstraint",
    "token_bytes",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)

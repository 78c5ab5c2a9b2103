"""Constraints and twists that enter SMC-SD weights (genlm-control potentials among them)."""

from .constraints import Constraint, PotentialConstraint, token_bytes
from .grammar import GrammarConstraint, JsonSchemaConstraint, RegexConstraint

__all__ = [
    "Constraint",
    "GrammarConstraint",
    "JsonSchemaConstraint",
    "PotentialConstraint",
    "RegexConstraint",
    "token_bytes",
]

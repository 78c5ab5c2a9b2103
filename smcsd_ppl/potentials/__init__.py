"""Constraints and twists that enter SMC-SD weights (genlm-control potentials among them)."""

from .constraints import Constraint, PotentialConstraint, RegexConstraint, allows, token_bytes
from .json_regex import schema_to_regex

__all__ = ["Constraint", "PotentialConstraint", "RegexConstraint", "allows", "schema_to_regex", "token_bytes"]

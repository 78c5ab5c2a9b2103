"""Constraints and twists that enter SMC-SD weights (genlm-control potentials among them)."""

from .constraints import Constraint, PotentialConstraint, RegexConstraint, token_bytes

__all__ = ["Constraint", "PotentialConstraint", "RegexConstraint", "token_bytes"]

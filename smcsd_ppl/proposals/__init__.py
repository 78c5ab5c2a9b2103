"""Proposal sources other than a draft model: retrieval (RACER-style)."""

"""SMC-SD's two names in the method table: the pair's engine runs both (``Engine.run``)."""

from __future__ import annotations

from ..config import paper_settings
from .registry import register_smcsd

register_smcsd("smcsd", lambda config: config)
register_smcsd("smcsd_paper", paper_settings)

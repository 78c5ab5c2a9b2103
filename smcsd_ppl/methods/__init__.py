"""Every generation method, by name: SMC-SD and its baselines (steering baselines: ``bench.steering``).

Importing this package registers each runner in ``METHODS``; SMC-SD's methods are the engine's
(``Engine.run``), registered with the settings they run.
"""

from . import ar, easd, hf_assisted, minedraft, racer, sd, smcsd  # noqa: F401 (they register)
from .registry import METHODS, Method, RunContext, get, register

__all__ = ["METHODS", "Method", "RunContext", "get", "register"]

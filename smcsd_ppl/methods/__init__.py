"""Every generation method, by name: SMC-SD and its baselines (steering baselines: ``bench.steering``).

Importing this package registers each runner in ``METHODS``.
"""

from . import ar, easd, hf_assisted, minedraft, racer, sd, smcsd  # noqa: F401 (they register)
from .registry import METHODS, Method, MethodOutput, RunContext, get, register
from .smcsd import run_programs

__all__ = ["METHODS", "Method", "MethodOutput", "RunContext", "get", "register", "run_programs"]

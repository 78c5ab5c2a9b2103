"""Generating for a file of prompts: the prompts read, one output record each, resumable; on Ray too.

``smcsd batch`` and ``smcsd generate`` run on this; the benchmarks (``smcsd_ppl.bench``) build on
it, never the other way round.
"""

from .prompts import Prompt, load_prompts
from .run import generate_one, run_batch

__all__ = ["Prompt", "generate_one", "load_prompts", "run_batch"]

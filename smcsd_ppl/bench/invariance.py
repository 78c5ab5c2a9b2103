"""How often a request's output changes with the batch it shares, on real models.

Each request draws from its own seed, so alone or in any batch it samples the same numbers;
only the forwards differ, in the last bits (a batch of other shapes takes other kernels and
summation orders). This runs each request alone, then all of them at once through the pair's
scheduler, and counts the requests whose tokens differ and where they first part.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import SMCConfig
from ..inference.program import SMCSDModel
from ..inference.step import request_seed


def batch_rounding(pair, prompts: Sequence[str], config: SMCConfig) -> dict:
    """Each prompt alone, then all together (same seeds): how many outputs differ, and where."""
    ids = [pair.encode(p) for p in prompts]
    alone = [pair.generate_ids([i], config=config)[0].token_ids for i in ids]
    sched = pair.scheduler
    seed = request_seed(config.seed, 0)  # as a call of one prompt seeds it
    tickets = [sched.submit_program(SMCSDModel(i), config, seed=seed, bounded=False) for i in ids]
    together = [t.wait().token_ids for t in tickets]
    parted = [_first_difference(a, b) for a, b in zip(alone, together)]
    changed = [p for p in parted if p is not None]
    return {
        "requests": len(ids),
        "changed": len(changed),
        "changed_fraction": len(changed) / len(ids),
        "first_difference": changed,
        "tokens": sum(len(a) for a in alone),
    }


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if n is None and len(a) != len(b):
        n = min(len(a), len(b))
    return n

"""SMC-SD's two names in the method table: the pair's engine runs both (``Engine.run``).

``smcsd_paper`` also runs on the static path's graphs (``--engine compiled``), through the
runner here; every other SMC-SD call is a request of the engine's batch.
"""

from __future__ import annotations

import dataclasses

from ..config import paper_settings
from ..inference.static_smcsd import static_smcsd
from ..inference.step import request_seed
from ..results import Generation
from .registry import RunContext, register_smcsd


def _static_paper(ctx: RunContext) -> list[Generation]:
    """The paper's algorithm on the static path: what the eager kernel returns, from compiled graphs."""
    config = paper_settings(ctx.config)
    static = ctx.pair.static_engine("smcsd_paper")
    seeds = [request_seed(config.seed, i) for i in range(len(ctx.prompts))]
    results = static_smcsd(static, ctx.prompts, config, ctx.eos, seeds, on_step=ctx.on_progress)
    for r in results:
        r.info.particles = [dataclasses.replace(p, text=ctx.decode(p.token_ids)) for p in r.info.particles]
    return ctx.generations(
        [r.token_ids for r in results],
        [r.info for r in results],
        messages=[r.message for r in results],
    )


register_smcsd("smcsd", lambda config: config)
register_smcsd("smcsd_paper", paper_settings, static=_static_paper)

"""SMC-SD as a method: user programs, or the default plain-generation program, in one batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ..config import paper_settings
from ..engine.run import run_smc_sd
from ..inference.program import SMCSDModel
from ..inference.state import StepInfo
from ..inference.static_smcsd import static_smcsd
from ..inference.step import request_seed
from .registry import MethodOutput, RunContext, register


def run_programs(
    ctx: RunContext, programs: Sequence[SMCSDModel], on_cycle: Callable[[StepInfo], None] | None = None
) -> MethodOutput:
    """SMC-SD over user programs (or the default one), all requests in one batch.

    The programs' own texts come back (a program decides its particles' text with
    ``ctx.decode``), with SMC-SD's report of each request.
    """

    def report(info: StepInfo) -> None:
        if ctx.on_progress is not None:
            ctx.on_progress(info.tokens)
        if on_cycle is not None:
            on_cycle(info)

    results = run_smc_sd(
        programs,
        ctx.rows(),
        ctx.config,
        ctx.eos,
        record=ctx.draft_record,
        encode=ctx.encode,
        decode=ctx.decode,
        on_cycle=report,
    )
    return MethodOutput(
        [r.token_ids for r in results],
        [r.info for r in results],
        [r.text for r in results],
        [r.message for r in results],
        [r.reason for r in results],
    )


@register("smcsd", particles=True)
def _smcsd(ctx: RunContext) -> MethodOutput:
    return run_programs(ctx, [SMCSDModel(i) for i in ctx.prompts])


@register("smcsd_paper", particles=True)
def _smcsd_paper(ctx: RunContext) -> MethodOutput:
    ctx = dataclasses.replace(ctx, config=paper_settings(ctx.config))
    static = ctx.pair.static_engine("smcsd_paper")
    if static is not None:
        return _static_paper(ctx, static)
    return run_programs(ctx, [SMCSDModel(i) for i in ctx.prompts])


def _static_paper(ctx: RunContext, static) -> MethodOutput:
    """The paper's algorithm on the static path: what the eager kernel returns, from compiled graphs."""
    seeds = [request_seed(ctx.config.seed, i) for i in range(len(ctx.prompts))]
    results = static_smcsd(static, ctx.prompts, ctx.config, ctx.eos, seeds, on_step=ctx.on_progress)
    for r in results:
        r.info.particles = [dataclasses.replace(p, text=ctx.decode(p.token_ids)) for p in r.info.particles]
    return MethodOutput(
        [r.token_ids for r in results],
        [r.info for r in results],
        messages=[r.message for r in results],
    )

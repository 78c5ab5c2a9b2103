"""SMC-SD as a method: user programs, or the default plain-generation program, in one batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ..engine.run import run_smc_sd
from ..inference.program import SMCSDModel
from ..inference.state import StepInfo
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
    )


@register("smcsd", particles=True)
def _smcsd(ctx: RunContext) -> MethodOutput:
    return run_programs(ctx, [SMCSDModel(i) for i in ctx.prompts])


@register("smcsd_paper", particles=True)
def _smcsd_paper(ctx: RunContext) -> MethodOutput:
    ctx = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, cut=None, proposal="draft"))
    return run_programs(ctx, [SMCSDModel(i) for i in ctx.prompts])

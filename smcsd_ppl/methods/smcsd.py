"""SMC-SD as a method: user programs, or the default plain-generation program, in one batch."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence

from ..inference.loop import CycleInfo, SMCResult, run_smc_sd
from ..inference.program import SMCSDModel
from .registry import MethodOutput, RunContext, register


def run_programs(
    ctx: RunContext, programs: Sequence[SMCSDModel], on_cycle: Callable[[CycleInfo], None] | None = None
) -> MethodOutput:
    """SMC-SD over user programs (or the default one), all requests in one batch.

    The programs' own texts come back (a program decides its particles' text with
    ``ctx.decode``), with every SMC field of each request.
    """

    def report(info: CycleInfo) -> None:
        if ctx.on_progress is not None:
            ctx.on_progress(info.tokens)
        if on_cycle is not None:
            on_cycle(info)

    results = run_smc_sd(programs, ctx.engine(), encode=ctx.encode, decode=ctx.decode, on_cycle=report)
    return MethodOutput(
        [r.token_ids for r in results], [_smc_fields(r) for r in results], [r.text for r in results]
    )


def _smc_fields(r: SMCResult) -> dict:
    """The ``Generation`` fields of one SMC-SD request."""
    return dict(
        log_z=r.log_z,
        n_resamples=r.n_resamples,
        mean_ess=statistics.fmean(r.ess_trace) if r.ess_trace else None,
        particles=r.particles,
        ess_trace=r.ess_trace,
        message=r.message,
        collapsed=r.collapsed,
        draft_lengths=r.draft_lengths,
    )


@register("smcsd", particles=True, summary="SMC speculative decoding (N particles x K-token blocks)")
def _smcsd(ctx: RunContext) -> MethodOutput:
    return run_programs(ctx, [SMCSDModel(i) for i in ctx.prompts])


@register(
    "smcsd_paper", particles=True, summary="the paper's SMC-SD: whole K-token blocks, fixed N and K (no cut)"
)
def _smcsd_paper(ctx: RunContext) -> MethodOutput:
    ctx = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, cut=None))
    return run_programs(ctx, [SMCSDModel(i) for i in ctx.prompts])

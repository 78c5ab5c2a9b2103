"""SMC-SD as a method: user programs, or the default plain-generation program, in one batch."""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING

from ..inference.loop import CycleInfo, run_smc_sd
from ..inference.program import SMCSDModel
from ..results import Generation
from .registry import register

if TYPE_CHECKING:
    from ..api import SMCSD


def run_programs(
    pair: SMCSD, programs, config, on_progress=None, on_cycle=None, name: str = "smcsd"
) -> list[Generation]:
    """SMC-SD over user programs (or the default one), all requests in one batch."""

    def report(info: CycleInfo) -> None:
        if on_progress is not None:
            on_progress(info.tokens)
        if on_cycle is not None:
            on_cycle(info)

    results = run_smc_sd(
        programs, pair.engine(config), encode=pair.encode, decode=pair.decode, on_cycle=report
    )
    return [
        Generation(
            r.text,
            r.token_ids,
            name,
            None,
            log_z=r.log_z,
            n_resamples=r.n_resamples,
            mean_ess=statistics.fmean(r.ess_trace) if r.ess_trace else None,
            particles=r.particles,
            ess_trace=r.ess_trace,
            message=r.message,
            collapsed=r.collapsed,
            draft_lengths=r.draft_lengths,
        )
        for r in results
    ]


@register("smcsd", particles=True, summary="SMC speculative decoding (N particles x K-token blocks)")
def _smcsd(pair, ids, config, on_progress):
    return run_programs(pair, [SMCSDModel(i) for i in ids], config, on_progress)


@register(
    "smcsd_paper", particles=True, summary="the paper's SMC-SD: whole K-token blocks, fixed N and K (no cut)"
)
def _smcsd_paper(pair, ids, config, on_progress):
    config = dataclasses.replace(config, cut=None)
    return run_programs(pair, [SMCSDModel(i) for i in ids], config, on_progress, name="smcsd_paper")

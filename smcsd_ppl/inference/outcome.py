"""A finished request's result: its output particle, drawn by weight, and SMC-SD's report of it.

The loop that steps requests to their end is the engine's (``engine.core``).
"""

from __future__ import annotations

import statistics

import torch

from .. import smc
from ..config import DraftRecord
from ..ends import FinishReason, finish_reason
from ..keys import derive, generator
from ..results import Generation, ParticleOut, SMCInfo, generation
from .program import SMCSDModel
from .schedule import learned
from .state import Population, final_log_z
from .step import SMCSDKernel

# A request whose ESS averages under this share of its particles is flagged as collapsed:
# its output is then close to the best of a few draft samples, not a target sample.
COLLAPSE_ESS_FRACTION = 0.3


def smc_info(pop: Population, record: DraftRecord) -> SMCInfo:
    """SMC-SD's report of one finished request."""
    log_w = pop.log_weights()
    several = [e for e, n in zip(pop.ess_trace, pop.particle_trace) if n >= 2]
    return SMCInfo(
        log_z=final_log_z(pop),
        particles=[ParticleOut(list(p.token_ids), p.text, float(w)) for p, w in zip(pop.particles, log_w)],
        ess_trace=list(pop.ess_trace),
        particle_trace=list(pop.particle_trace),
        # with no cycle of two or more particles, the final weights' ESS
        mean_ess=statistics.fmean(several) if several else smc.ess(log_w),
        n_resamples=pop.n_resamples,
        collapsed=bool(pop.ess_fractions) and statistics.fmean(pop.ess_fractions) < COLLAPSE_ESS_FRACTION,
        draft_lengths=list(pop.schedule.lengths) if pop.schedule else [],
        proposals=["+".join(dict.fromkeys(k)) for k in pop.schedule.kinds] if pop.schedule else [],
        draft_record=learned(record, pop.schedule) if pop.schedule else record,
    )


def result_of(pop: Population, kernel: SMCSDKernel, record: DraftRecord) -> Generation:
    """A finished request's output particle, drawn by weight (or the heaviest), with SMC-SD's report.

    Its stats are the caller's to add, and stop strings its to apply (the reason here is the
    tokens': ``ends.finish_reason``, or ``error`` when every particle died).
    """
    info, log_w = smc_info(pop, record), pop.log_weights()
    if not torch.isfinite(log_w).any():
        return generation("smcsd", "", [], None, FinishReason.ERROR, _why_dead(pop), info)
    if kernel.settings(pop).selection == "argmax":
        info.chosen = int(torch.argmax(log_w))
    else:  # each request draws its output from its own stream
        g = generator(derive(pop.seed, "choose"))
        info.chosen = int(smc.resample(log_w, "multinomial", g, 1)[0])
    best, particle = info.particles[info.chosen], pop.particles[info.chosen]
    constrained = getattr(particle, "constraint", None) is not None
    budget = kernel.settings(pop).max_new_tokens
    reason = finish_reason(best.token_ids, budget, kernel.eos_of(pop), constrained=constrained)
    return generation(
        "smcsd", best.text, best.token_ids, None, reason, _cut_short(pop, particle, kernel), info
    )


def _why_dead(pop: Population) -> str:
    """What killed every particle: a constraint (by mode), else the program's conditions."""
    reasons = {p.__dict__.get("killed_by") for p in pop.particles} - {None}
    if "critic" in reasons:
        return (
            "every particle has zero weight: the constraint (critic mode) rejected every block, "
            "since the target rarely writes exactly what it allows; use mode='proposal', which drafts "
            "only allowed tokens"
        )
    if "proposal" in reasons:
        return (
            "every particle has zero weight: the constraint allowed no way on (a dead end) within "
            "max_new_tokens"
        )
    return "every particle has zero weight: no particle satisfied the program's conditions"


def _cut_short(pop: Population, p: SMCSDModel, kernel: SMCSDKernel) -> str:
    """Say so when the budget ended a constrained output before the constraint was met."""
    c, ids, budget = p.constraint, p.token_ids, kernel.settings(pop).max_new_tokens
    if c is None or len(ids) < budget:
        return ""
    eos = kernel.eos_of(pop)
    if ids and ids[-1] in eos:
        return ""
    # Could it end here? Then the output satisfies the constraint. A run without EOS ids asks
    # the constraint's own (a constraint that declares none cannot tell: no message).
    if c.allows([[*ids, min(eos)]])[0] if eos else not c.eos_token_ids or c.is_complete(ids):
        return ""
    return (
        f"incomplete: max_new_tokens ({budget}) ran out before the constraint was "
        "met; the text is only a prefix of a valid output (raise max_new_tokens)"
    )

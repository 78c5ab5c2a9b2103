"""The generation methods a user can pick by name, on one pair of backends.

Each method is a runner ``(pair, prompt_ids, config, on_progress) -> [Generation]``
registered under a name; ``SMCSD.generate`` times the call and fills in the stats.
Baselines in their own modules register themselves with ``@register``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .baselines.ar import autoregressive
from .baselines.sd import speculative_sampling
from .config import SMCConfig
from .inference.program import SMCSDModel
from .inference.smc import CycleInfo, run_smc_sd
from .results import Generation

if TYPE_CHECKING:
    from .generate import SMCSD

Runner = Callable[["SMCSD", list[list[int]], SMCConfig, "Callable[[int], None] | None"], list[Generation]]


@dataclass(frozen=True)
class Method:
    """A named generation method.

    Attributes:
        run: the runner.
        uses_draft: it feeds the draft model (and may draft past the budget by a block).
        particles: it holds ``n_particles`` rows per prompt.
        summary: one line for help texts.
    """

    name: str
    run: Runner
    uses_draft: bool
    particles: bool
    summary: str


METHODS: dict[str, Method] = {}
"""Every registered method by name (filled by ``register``; the baselines register on import)."""


def register(name: str, *, uses_draft: bool = True, particles: bool = False, summary: str = ""):
    """Decorator adding a runner to ``METHODS`` under ``name``."""

    def add(run: Runner) -> Runner:
        METHODS[name] = Method(name, run, uses_draft, particles, summary)
        return run

    return add


def get(name: str) -> Method:
    """The method called ``name``, or a ``ValueError`` listing the known ones."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {name!r}")
    return METHODS[name]


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


@register("sd", summary="exact speculative sampling (Leviathan et al.)")
def _sd(pair, ids, config, on_progress):
    run = speculative_sampling(pair.engine(config), ids, on_step=on_progress)
    return [Generation(pair.decode(t), t, "sd", None, acceptance=run.acceptance) for t in run.token_ids]


@register("ar", uses_draft=False, summary="autoregressive sampling from the target")
def _ar(pair, ids, config, on_progress):
    g = torch.Generator(device=pair.target_lm.device).manual_seed(config.seed)
    run = autoregressive(
        pair.target_lm,
        ids,
        eos_token_ids=pair.eos_for(config),
        max_new_tokens=config.max_new_tokens,
        temperature=config.target_temperature,
        g=g,
        on_step=on_progress,
    )
    return [Generation(pair.decode(t), t, "ar", None) for t in run.token_ids]


# Baselines in their own modules register themselves on import.
from .baselines import easd, hf_assisted, minedraft, racer  # noqa: E402, F401

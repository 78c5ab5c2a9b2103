"""A run's explicit state: each request's particles and the SMC bookkeeping around them.

``SMCState`` is what ``SMCSDKernel.step`` takes and returns: every field is a value, and a
step builds new ones instead of writing the old. The particles are the user's LLaMPPL
programs, which step in place as in LLaMPPL; their KV state lives in the row store, which
a step moves on, so a state is read once, by the step that follows it.

Every change of a population's particles (resampling, shrinking to one particle, growing)
goes through ``reshape``, which adds the log Z increment once.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import torch

from .. import smc
from ..config import DraftRecord
from .program import SMCSDModel
from .schedule import DraftSchedule


@dataclass(frozen=True)
class Population:
    """One request's particles, with its log Z estimate and ESS history.

    Attributes:
        particles: the particles (LLaMPPL programs; ``weight`` is each one's log-weight).
        log_z: log Z accumulated over the reshapes so far (the current weights not included).
        ess_trace: ESS before each cycle's resampling decision.
        particle_trace: the particles each cycle ran.
        ess_fractions: ESS / N on the cycles that ran N >= 2 particles.
        n_resamples: resampling rounds.
        schedule: the request's draft schedule (None without the quality cut).
    """

    particles: tuple[SMCSDModel, ...]
    log_z: float = 0.0
    ess_trace: tuple[float, ...] = ()
    particle_trace: tuple[int, ...] = ()
    ess_fractions: tuple[float, ...] = ()
    n_resamples: int = 0
    schedule: DraftSchedule | None = None

    def log_weights(self) -> torch.Tensor:
        """The particles' log-weights ``[N]`` (float64; NaN cleaned to -inf)."""
        return smc.clean_log_weights(torch.tensor([p.weight for p in self.particles], dtype=torch.float64))

    @property
    def stepping(self) -> bool:
        """Some particle still steps."""
        return any(not p.done_stepping() for p in self.particles)


@dataclass(frozen=True)
class SMCState:
    """Every request of a run, between two steps.

    Attributes:
        populations: one per request, in request order.
        record: the draft record the run started from.
        cycle: steps taken.
        idle: the latest steps in a row in which no particle did anything.
    """

    populations: tuple[Population, ...]
    record: DraftRecord
    cycle: int = 0
    idle: int = 0

    @property
    def done(self) -> bool:
        """No particle of any request steps any more."""
        return not any(pop.stepping for pop in self.populations)


@dataclass(frozen=True)
class StepInfo:
    """What one step did (BlackJAX-style step info).

    Attributes:
        cycle: the step's number (1 for the first).
        live: particles still stepping after it, all requests.
        tokens: tokens of the longest particle so far.
        ess: ESS per request before any resampling.
        resampled: per request, whether it resampled.
        settled: per request, the tokens every particle of finite weight shares: every output
            the request can still return extends them (what a stream may show).
    """

    cycle: int
    live: int
    tokens: int
    ess: tuple[float, ...]
    resampled: tuple[bool, ...]
    settled: tuple[tuple[int, ...], ...] = ()


def settled_tokens(pop: Population) -> tuple[int, ...]:
    """The longest token prefix shared by every particle of finite weight (none alive: empty)."""
    alive = [p.token_ids for p, w in zip(pop.particles, pop.log_weights().tolist()) if w > -math.inf]
    if not alive:
        return ()
    first, n = alive[0], min(len(a) for a in alive)
    n = next((i for i in range(n) if any(a[i] != first[i] for a in alive)), n)
    return tuple(first[:n])


def reshape(pop: Population, ancestors: list[int], log_w: torch.Tensor) -> Population:
    """The population of ``ancestors``' copies, with weights reset and log Z updated once.

    Resampling (M = N), shrinking (M = 1) and growing (M > N) all go through here: each
    draws M ancestors in proportion to the weights, so log Z gains log mean exp(log_w).
    """
    used: set[int] = set()
    particles = []
    for a in ancestors:  # the first copy of an ancestor is the ancestor itself
        particles.append(pop.particles[a] if a not in used else copy.deepcopy(pop.particles[a]))
        used.add(a)
    for p in particles:
        p.weight = 0.0
    return replace(pop, particles=tuple(particles), log_z=pop.log_z + smc.log_mean_exp(log_w))


def resampled(pop: Population, scheme: str, g: torch.Generator, m: int | None = None) -> Population:
    """``reshape`` to ``m`` particles (default: as many) drawn with ``scheme``; kept if every weight is 0."""
    log_w = pop.log_weights()
    if not torch.isfinite(log_w).any():
        return pop
    return reshape(pop, smc.resample(log_w, scheme, g, m).tolist(), log_w)


def final_log_z(pop: Population) -> float:
    """Log Z of a finished request: the reshapes' increments plus the final weights' mean."""
    log_w = pop.log_weights()
    return pop.log_z + smc.log_mean_exp(log_w) if torch.isfinite(log_w).any() else -math.inf

"""A run's explicit state: each request's particles and the SMC bookkeeping around them.

``SMCState`` is what ``SMCSDKernel.step`` takes and returns, and it is a value: a step never
writes the state it was given. The particles are the user's LLaMPPL programs, which step in
place as in LLaMPPL, so a step steps copies of them (``Population.bound``) and the state
treats every particle object as frozen: two slots may share one object after resampling.
What a particle owns apart from its program lives on the population, as tuples: its
log-weight and its contexts' rows in the row store (which a step moves on).

Every change of a population's particles (resampling, shrinking to one particle, growing)
goes through ``reshape``, one gather that gives each drawn particle the average weight, as
LLaMPPL does, so the final weights' log-mean-exp estimates log Z whether or not a request
resampled.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .. import smc
from ..config import SMCConfig
from ..proposals.blocks import RequestIndex
from .program import Runtime, SMCSDModel
from .schedule import DraftSchedule


@dataclass(frozen=True)
class Population:
    """One request's particles, their weights and rows, with its ESS history and settings.

    Attributes:
        particles: the particles (LLaMPPL programs), never written once in a state.
        weights: each particle's log-weight (its program's ``weight`` while it steps).
        rows: each particle's contexts' rows in the row store (-1: released).
        seed: the request's seed; its resampling draws come from it alone.
        ess_trace: ESS before each cycle's resampling decision.
        particle_trace: the particles each cycle ran.
        ess_fractions: ESS / N on the cycles that ran N >= 2 particles.
        n_resamples: resampling rounds.
        schedule: the request's draft schedule (None without the quality cut).
        ancestors: the slots each particle was drawn from at the latest reshape (empty: none yet).
        config: the request's own settings (None: the run's).
        retrieval: the request's retrieval index (None: no proposal retrieves); like the row
            store, a step feeds it.
        request_id: the id of the request it is (empty for runs that name none).
        fault: what the engine did wrong on its rows (NaN logits): the request fails with it.
        draft_calls: the draft forwards that drew its particles' blocks up to their ends.
    """

    particles: tuple[SMCSDModel, ...]
    weights: tuple[float, ...]
    rows: tuple[tuple[int, ...], ...]
    seed: int = 0
    ess_trace: tuple[float, ...] = ()
    particle_trace: tuple[int, ...] = ()
    ess_fractions: tuple[float, ...] = ()
    n_resamples: int = 0
    schedule: DraftSchedule | None = None
    ancestors: tuple[int, ...] = ()
    config: SMCConfig | None = None
    retrieval: RequestIndex | None = None
    request_id: str = ""
    fault: str = ""
    draft_calls: int = 0

    def __post_init__(self) -> None:
        assert len(self.particles) == len(self.weights) == len(self.rows), "one weight and row set a particle"

    def log_weights(self) -> torch.Tensor:
        """The particles' log-weights ``[N]`` (float64; NaN cleaned to -inf)."""
        return smc.clean_log_weights(torch.tensor(self.weights, dtype=torch.float64))

    @property
    def cycles(self) -> int:
        """Steps the request has run (its own count: it may have joined a running batch)."""
        return len(self.particle_trace)

    @property
    def stepping(self) -> bool:
        """Some particle still steps."""
        return any(not p.done_stepping() for p in self.particles)

    def bound(self, runtime: Runtime) -> Population:
        """The population a step runs: a fresh copy of every particle that may change, bound to it.

        A copy carries its slot's weight and rows and the step's runtime; finished particles
        with nothing to untwist are shared as they are. The twist of the last step is
        divided out here, as LLaMPPL does before each step.
        """
        particles = []
        for p, w, rows in zip(self.particles, self.weights, self.rows):
            if p.done_stepping() and not p.twist_amount:
                particles.append(p)
                continue
            p = copy.deepcopy(p)
            p.runtime, p.weight = runtime, w
            for ctx, row in zip(p.contexts(), rows):
                ctx.row, ctx.runtime = row, runtime
            p.untwist()
            particles.append(p)
        return replace(self, particles=tuple(particles), weights=tuple(p.weight for p in particles))

    def stepped(self, before: Population) -> Population:
        """This bound population after its particles stepped: their programs' weights read back.

        ``before`` is the population it was bound from; particles shared with it did not step.
        """
        weights = (
            w if p is q else float(p.weight)
            for p, q, w in zip(self.particles, before.particles, before.weights)
        )
        return replace(self, weights=tuple(weights))


@dataclass(frozen=True)
class SMCState:
    """Every request of a run, between two steps.

    Attributes:
        populations: one per request, in request order.
        cycle: steps taken.
        idle: the latest steps in a row in which no particle did anything.
    """

    populations: tuple[Population, ...]
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
        populations: the populations after it (values: read them, do not keep them alive).
        before: the populations once their programs stepped, before any resampling (what
            LLaMPPL's SMC record shows of a step).
    """

    cycle: int
    live: int
    tokens: int
    ess: tuple[float, ...]
    resampled: tuple[bool, ...]
    populations: tuple[Population, ...] = ()
    before: tuple[Population, ...] = ()

    def narrowed(self, requests: Sequence[int]) -> StepInfo:
        """This step as the requests at ``requests`` (indices into ``populations``) saw it, in that order.

        Its ``cycle`` is theirs: the most steps any of them has run (they may have joined a
        running batch).
        """
        pops = tuple(self.populations[i] for i in requests)
        every = [p for pop in pops for p in pop.particles]
        return StepInfo(
            max((pop.cycles for pop in pops), default=self.cycle),
            sum(not p.done_stepping() for p in every),
            max((len(p.token_ids) for p in every), default=0),
            tuple(self.ess[i] for i in requests),
            tuple(self.resampled[i] for i in requests),
            pops,
            tuple(self.before[i] for i in requests) if self.before else (),
        )

    def settled(self, request: int) -> tuple[int, ...]:
        """The tokens every particle of finite weight of ``request`` shares (what a stream may show).

        Every output the request can still return extends them.
        """
        return settled_tokens(self.populations[request])


def settled_tokens(pop: Population) -> tuple[int, ...]:
    """The longest token prefix shared by every particle of finite weight (none alive: empty)."""
    alive = [p.token_ids for p, w in zip(pop.particles, pop.weights) if w > -math.inf]
    if not alive:
        return ()
    low, high = min(alive), max(alive)  # the set's common prefix is theirs (lexicographic order)
    n = next((i for i, (a, b) in enumerate(zip(low, high)) if a != b), min(len(low), len(high)))
    return tuple(low[:n])


def reshape(pop: Population, ancestors: list[int], log_w: torch.Tensor) -> Population:
    """The population of ``ancestors``' particles, each with the average weight.

    Resampling (M = N), shrinking (M = 1) and growing (M > N) all go through here: each
    draws M ancestors in proportion to the weights, and each draw carries the average
    weight log mean exp(log_w), the evidence so far. Particles are gathered, not copied:
    a step copies what it steps.
    """
    average = smc.log_mean_exp(log_w)
    return replace(
        pop,
        particles=tuple(pop.particles[a] for a in ancestors),
        weights=(average,) * len(ancestors),
        rows=tuple(pop.rows[a] for a in ancestors),
        ancestors=tuple(ancestors),
    )


def resampled(pop: Population, scheme: str, g: torch.Generator, m: int | None = None) -> Population:
    """``reshape`` to ``m`` particles (default: as many) drawn with ``scheme``; kept if every weight is 0."""
    log_w = pop.log_weights()
    if not torch.isfinite(log_w).any():
        return pop
    return reshape(pop, smc.resample(log_w, scheme, g, m).tolist(), log_w)


def final_log_z(pop: Population) -> float:
    """Log Z of a finished request: the log-mean-exp of its final weights (-inf if all are 0)."""
    log_w = pop.log_weights()
    return smc.log_mean_exp(log_w) if torch.isfinite(log_w).any() else -math.inf


def final_particles(pop: Population) -> list[SMCSDModel]:
    """A finished request's particles as LLaMPPL hands them back: each a copy holding its weight.

    The copies hold no rows (their contexts' ``row`` is -1): a row is a step's to read.
    """
    out = []
    for p, w in zip(pop.particles, pop.weights):
        p = copy.deepcopy(p)
        p.weight = w
        for ctx in p.contexts():
            ctx.row = -1
        out.append(p)
    return out

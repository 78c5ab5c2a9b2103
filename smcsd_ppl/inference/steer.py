"""LLaMPPL's ``smc_steer`` on the batched engine: beam-like SMC with without-replacement resampling.

Each round, every unfinished particle of N is stepped as K children (slots of one value,
copied when they step) and finished particles are carried; with M children in all, every
weight is first scaled by M / N and an unfinished one's also by 1 / K. N children are then
kept by LLaMPPL's "optimal" resampling: with c from LLaMPPL's search for
sum_i min(c p_i, 1) = N over the normalized weights p, every child with c p_i >= 1 is
kept surely (weight scaled back by N / M), and the others by one stratified pass, each
kept one weighing (total weight) / c, scaled by N / M. Nothing is kept twice; when every
child is dead the first N are kept. ``Steering`` is that as a reshape the engine applies
around each step, so every token-level step of a round shares one target forward; the kernel
itself never resamples here (its ESS threshold is 0).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from ..keys import derive, generator
from .state import Population


def _uniform(g: torch.Generator) -> float:
    """A uniform draw in [0, 1) for the stratified pass."""
    return float(torch.rand(1, generator=g, dtype=torch.float64))


def threshold(probs: np.ndarray, n: int) -> float:
    """The c with sum_i min(c p_i, 1) = n (LLaMPPL's ``find_c``; n when no weight sets it)."""
    order = np.sort(probs)
    below = np.cumsum(order)  # mass of the weights up to each sorted one
    above = len(order) - 1 - np.arange(len(order))  # how many weights lie above it
    with np.errstate(divide="ignore", invalid="ignore"):
        fits = below / order + above - n <= 1e-12
    hits = np.flatnonzero(fits)
    if not len(hits):
        return float(n)
    i = hits[0]
    return float((n - above[i]) / below[i])


def keep(probs: np.ndarray, n: int, draw) -> tuple[np.ndarray, np.ndarray, float]:
    """Which children to keep: (sure ones, drawn ones, c); ``draw()`` gives a uniform in [0, 1).

    The drawn ones come from one stratified walk over the light children in index order,
    with n - (sure ones) strata; ``draw`` is called only when there is a stratum.
    """
    c = threshold(probs, n)
    sure = np.flatnonzero(c * probs >= 1)
    light = np.flatnonzero(c * probs < 1)
    strata = n - len(sure)
    if strata == 0:
        return sure, np.array([], dtype=int), c
    width = np.sum(probs[light]) / strata
    u, drawn = width * draw(), []
    for i in light:  # a point every `width` of mass; a child whose mass holds one is kept
        u -= probs[i]
        if u <= 0:
            drawn.append(i)
            u += width
    return sure, np.array(drawn, dtype=int), c


def expanded(pop: Population, n: int, k: int) -> Population:
    """Every unfinished particle as k children (its copies are made when they step), weighed as LLaMPPL does.

    Every weight is scaled by (children in all) / n, an unfinished particle's children's also
    by 1 / k. The twist of the last step is divided out when the children step.
    """
    done = [p.done_stepping() for p in pop.particles]
    total = sum(done) + (len(done) - sum(done)) * k
    slots, weights = [], []
    for i, (w, ended) in enumerate(zip(pop.weights, done)):
        w += math.log(total) - math.log(n)
        slots += [i] if ended else [i] * k
        weights += [w] if ended else [w - math.log(k)] * k
    return _gathered(pop, slots, weights)


def _gathered(pop: Population, slots: list[int], weights: list[float]) -> Population:
    """The population of ``slots``' particles and rows, with ``weights``."""
    return replace(
        pop,
        particles=tuple(pop.particles[i] for i in slots),
        weights=tuple(weights),
        rows=tuple(pop.rows[i] for i in slots),
    )


def selected(pop: Population, n: int, g: torch.Generator) -> Population:
    """N of the stepped children, by LLaMPPL's without-replacement resampling, reweighted."""
    w = np.array(pop.weights, dtype=np.float64)
    if not np.isfinite(w).any():
        return _gathered(pop, list(range(n)), list(pop.weights[:n]))  # every child is dead
    top = np.max(w)
    total = float(np.log(np.sum(np.exp(w - top))) + top)
    probs = np.exp(w - total)
    sure, drawn, c = keep(probs, n, lambda: _uniform(g))
    share = math.log(n) - math.log(len(w))
    weights = [float(w[i]) + share for i in sure] + [total - math.log(c) + share for i in drawn]
    return _gathered(pop, [int(i) for i in np.concatenate([sure, drawn])], weights)


class Steering:
    """LLaMPPL's ``smc_steer`` as a reshape of one request's population around each step.

    Before a step every unfinished particle becomes ``k`` children; after it, ``n`` of them
    are kept. Run it with ``ess_threshold=0`` and no quality cut: the kernel itself must
    neither resample nor resize. ``seed`` seeds the stratified draws.
    """

    def __init__(self, n: int, k: int, seed: int) -> None:
        self.n, self.k = n, k
        self.generator = generator(derive(seed, "steer"))

    def before(self, pop: Population) -> Population:
        """Every unfinished particle as ``k`` children."""
        return expanded(pop, self.n, self.k)

    def after(self, pop: Population) -> Population:
        """``n`` of the stepped children."""
        return selected(pop, self.n, self.generator)

"""LLaMPPL's ``smc_steer`` on the batched engine: beam-like SMC with without-replacement resampling.

Each round, every unfinished particle of N is stepped as K children and finished particles
are carried; with M children in all, every weight is first scaled by M / N and an
unfinished one's also by 1 / K. N children are then kept by LLaMPPL's "optimal"
resampling: with c from LLaMPPL's search for sum_i min(c p_i, 1) = N over the normalized
weights p, every child with c p_i >= 1 is kept surely (weight scaled back by N / M), and
the others by one stratified pass, each kept one weighing (total weight) / c, scaled by
N / M. Nothing is kept twice; when every child is dead the first N are kept. The children
step through the kernel, so every token-level step of a round shares one target forward;
the kernel itself never resamples here (its ESS threshold is 0).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import torch

from .step import SMCSDKernel, step_key


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


def expanded(particles, n: int, k: int) -> list:
    """Every unfinished particle as k children (itself first), weights shifted as LLaMPPL does."""
    done = sum(p.done_stepping() for p in particles)
    total = done + (len(particles) - done) * k
    out = []
    for p in particles:
        p.untwist()
        p.weight += math.log(total) - math.log(n)
        out.append(p)
        if not p.done_stepping():
            p.weight -= math.log(k)
            out.extend(copy.deepcopy(p) for _ in range(k - 1))
    return out


def _repack(store, particles) -> None:
    """Give each live particle's contexts rows of their own (children copy their parent's)."""
    rows = []
    for p in particles:
        for ctx in p.contexts():
            if p.done_stepping():
                ctx.row = -1
            else:
                rows.append(ctx.row)
                ctx.row = len(rows) - 1
    store.fork(rows)


def selected(children, n: int, g: torch.Generator) -> list:
    """N of the stepped children, by LLaMPPL's without-replacement resampling, reweighted."""
    w = np.array([p.weight for p in children], dtype=np.float64)
    if not np.isfinite(w).any():
        return list(children[:n])  # every child is dead: nothing to choose by
    top = np.max(w)
    total = float(np.log(np.sum(np.exp(w - top))) + top)
    probs = np.exp(w - total)
    sure, drawn, c = keep(probs, n, lambda: _uniform(g))
    share = math.log(n) - math.log(len(children))
    for i in sure:
        children[i].weight += share
    for i in drawn:
        children[i].weight = total - math.log(c) + share
    return [children[i] for i in np.concatenate([sure, drawn]).astype(int)]


async def steer(model, k, store, config, eos, record, encode, decode) -> list:
    """``smc_steer`` with ``config.n_particles`` particles and ``k`` children each: the final particles."""
    n = config.n_particles
    kernel = SMCSDKernel(store, replace(config, ess_threshold=0.0, cut=None), eos, decode)
    state = kernel.init([model], record, encode)
    g = torch.Generator().manual_seed(step_key(config.seed, -2))
    while not state.done:
        pop = state.populations[0]
        children = expanded(list(pop.particles), n, k)
        _repack(store, children)
        state = replace(state, populations=(replace(pop, particles=tuple(children)),))
        state, _ = await kernel.step(state, step_key(config.seed, state.cycle + 1))
        kept = selected(list(state.populations[0].particles), n, g)
        _repack(store, kept)
        state = replace(state, populations=(replace(state.populations[0], particles=tuple(kept)),))
    return list(state.populations[0].particles)

"""Stop strings on a population: a particle whose text holds one ends there."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace

from ..ends import before_stop
from ..inference.state import Population


def stopped_at(pop: Population, stop: Sequence[str]) -> Population:
    """``pop`` with every live particle whose text holds a stop string ended (``pop`` if none).

    The ended particles are fresh copies: the state's objects stay as they were.
    """
    hit = [bool(stop) and not p.done_stepping() and before_stop(p.text, stop)[1] for p in pop.particles]
    if not any(hit):
        return pop
    particles = []
    for p, h in zip(pop.particles, hit):
        if h:
            p = copy.deepcopy(p)
            p.finish()
        particles.append(p)
    return replace(pop, particles=tuple(particles))

"""What a scheduler makes of a request's population: its result, its stop strings, its rows."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import replace

from ..config import DraftRecord
from ..inference.loop import result_of
from ..inference.state import Population, SMCState
from ..inference.step import SMCSDKernel
from ..results import Generation, RunStats
from .ticket import before_stop


def generation_of(
    kernel: SMCSDKernel, record: DraftRecord, pop: Population, start: float, stop: Sequence[str]
) -> tuple[Generation, str]:
    """A finished request's ``Generation`` (its text cut before a stop string) and finish reason.

    Its stats are its own: its tokens, the time since ``start``, and a target call per cycle
    it ran (the forwards it shared with the requests around it).
    """
    out = result_of(pop, kernel, record)
    text, stopped = before_stop(out.text, stop)
    ids = out.token_ids
    ended = stopped or (bool(ids) and ids[-1] in kernel.eos) or len(ids) < kernel.settings(pop).max_new_tokens
    stats = RunStats("smcsd", len(ids), time.perf_counter() - start, max(1, pop.cycles), 0, 0.0, 0.0)
    generation = Generation(text, list(ids), "smcsd", stats, out.message, smc=out.info)
    return generation, "stop" if ended else "length"


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


def rows_in_use(state: SMCState) -> int:
    """Rows the live particles hold (released rows are -1)."""
    return sum(r >= 0 for pop in state.populations for rows in pop.rows for r in rows)

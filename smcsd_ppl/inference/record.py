"""LLaMPPL's SMC record of a run: what its HTML viewer reads, taken from our engine's steps.

LLaMPPL's ``smc_standard(..., json_file=...)`` writes one entry per step: the particles
after the step (their text and log-weight, and the weight each step added), marked
``init`` (the first step), ``smc_step``, or ``resample`` (a step that followed a
resampling; the entry then names each particle's ancestor in the entry before). This
module takes the same entries from each step's ``StepInfo`` (the particles between the step
and its resampling), with LLaMPPL's own ``SMCRecord``; it reads the states, never writes them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime

from llamppl.inference.smc_record import SMCRecord

from .state import StepInfo


@dataclass(frozen=True)
class _Entry:
    """A particle as the record reads it: its program and the weight its slot holds."""

    particle: object
    weight: float

    def string_for_serialization(self) -> str:
        return self.particle.string_for_serialization()


class Recorder:
    """An observer of one request's steps (``on_cycle``) that keeps LLaMPPL's record of them.

    Each step's entry holds the particles once they stepped, before any resampling
    (``StepInfo.before``); a step that follows a resampling names each particle's ancestor.
    """

    def __init__(self, n: int) -> None:
        self.history, self.ancestors = SMCRecord(n), None

    def __call__(self, info: StepInfo) -> None:
        """Record one step of the request."""
        [pop] = info.before
        entries = [_Entry(p, w) for p, w in zip(pop.particles, pop.weights)]
        if not self.history.history:
            self.history.add_init(entries)
        elif self.ancestors is not None:
            self.history.add_resample(self.ancestors, entries)  # reshaped since the latest entry
        else:
            self.history.add_smc_step(entries)
        self.ancestors = list(info.populations[0].ancestors) if info.resampled[0] else None


def write_record(history: SMCRecord, model, visualization_dir=None, json_file=None) -> str:
    """Write the record where LLaMPPL writes it; returns the path (nothing is printed)."""
    if visualization_dir is None:
        path = json_file
    else:
        name = json_file or f"{type(model).__name__}-{datetime.now():%Y%m%d-%H%M%S}.json"
        path = os.path.join(visualization_dir, name)
    with open(path, "w") as f:
        f.write(history.to_json())
    return path

"""LLaMPPL's SMC record of a run: what its HTML viewer reads, taken from our engine's steps.

LLaMPPL's ``smc_standard(..., json_file=...)`` writes one entry per step: the particles
after the step (their text and log-weight, and the weight each step added), marked
``init`` (the first step), ``smc_step``, or ``resample`` (a step that followed a
resampling; the entry then names each particle's ancestor in the entry before). This
module takes the same entries from the kernel, at the moment between a step and its
resampling, with LLaMPPL's own ``SMCRecord``; it reads the states, never writes them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime

from llamppl.inference.smc_record import SMCRecord

from .loop import run_to_end
from .state import final_particles
from .step import SMCSDKernel


@dataclass(frozen=True)
class _Entry:
    """A particle as the record reads it: its program and the weight its slot holds."""

    particle: object
    weight: float

    def string_for_serialization(self) -> str:
        return self.particle.string_for_serialization()


class RecordingKernel(SMCSDKernel):
    """The kernel, recording each step's particles before it resamples them."""

    def start_record(self, n: int) -> None:
        """Begin an empty record for a request of ``n`` particles."""
        self.history, self.ancestors = SMCRecord(n), None

    def _maybe_resample(self, pop, g):
        entries = [_Entry(p, w) for p, w in zip(pop.particles, pop.weights)]
        if not self.history.history:
            self.history.add_init(entries)
        elif self.ancestors is not None:
            self.history.add_resample(self.ancestors, entries)  # reshaped since the latest entry
        else:
            self.history.add_smc_step(entries)
        pop, ess, did = super()._maybe_resample(pop, g)
        self.ancestors = list(pop.ancestors) if did else None
        return pop, ess, did


async def recorded_run(model, store, config, eos, record, encode, decode, keep=True):
    """Run one program to the end; its final particles and LLaMPPL's record (None unless ``keep``)."""
    if not keep:
        _, state = await run_to_end([model], store, config, eos, record, encode, decode)
        return final_particles(state.populations[0]), None
    kernel = RecordingKernel(store, config, eos, decode)
    kernel.start_record(config.n_particles)
    state = kernel.init([model], record, encode)
    while not state.done:
        state, _ = await kernel.step(state)
    return final_particles(state.populations[0]), kernel.history


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

"""The generation methods a user can pick by name, on one pair of backends.

Each method is a runner ``(pair, prompt_ids, config, on_progress) -> [Generation]``
registered under a name; ``SMCSD.generate`` times the call and fills in the stats.
Each runner's module registers it with ``@register``; importing ``smcsd_ppl.methods`` loads them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import SMCConfig
from ..results import Generation

if TYPE_CHECKING:
    from ..api import SMCSD

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

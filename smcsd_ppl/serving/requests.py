"""What a scheduler takes and tells: requests, the jobs they become, its errors, its snapshot."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import SMCConfig
from ..inference.program import SMCSDModel
from ..potentials.spec import ConstraintSpec
from .ticket import Ticket

SERVE_METHODS = ("smcsd", "ar")  # ar: one particle, the target alone (the same kernel, drafting nothing)
SHARED_SETTINGS = ("alpha", "cut", "cut_divergence", "ignore_eos")


class QueueFull(RuntimeError):
    """The scheduler's queue is full: try again later."""


class SchedulerClosed(RuntimeError):
    """The scheduler is closed (or closing) and takes no more requests."""


@dataclass(frozen=True)
class ServeRequest:
    """One request to a scheduler.

    Attributes:
        prompt_ids: the prompt's token ids (any chat template already applied).
        config: its settings (seed, budget, temperatures, N, K, ...).
        method: one of ``SERVE_METHODS``.
        constraint: a JSON Schema, regex or grammar every output must satisfy, or None.
        stop: stop strings: the output ends before the first one.
    """

    prompt_ids: list[int]
    config: SMCConfig = field(default_factory=SMCConfig)
    method: str = "smcsd"
    constraint: ConstraintSpec | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in SERVE_METHODS:
            raise ValueError(
                f"unknown method {self.method!r} for serving; choose from {', '.join(SERVE_METHODS)}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty texts")


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of a scheduler: its queue, its rows, what it has done."""

    queued: int
    running: int
    rows_in_use: int
    max_rows: int
    max_queue: int
    requests_total: dict[str, int]
    tokens_total: int
    cycles_total: int
    cycle_seconds_total: float
    last_cycle_seconds: float
    last_mean_ess: float


@dataclass
class Job:
    """A request waiting for admission: its program, settings, seed and ticket."""

    ticket: Ticket
    program: SMCSDModel | None
    config: SMCConfig
    seed: int
    rows: int
    alone: Callable[[], object] | None = None  # a call that runs alone instead
    start: float = 0.0
    on_progress: Callable[[int], None] | None = None

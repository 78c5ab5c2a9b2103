"""What the engine holds of a request: an object with an id, a status and everything it runs with.

A ``Request`` is an SMC-SD program with its settings, seed and stop strings; a ``Call`` is any
other work on the pair's rows (another method, a custom loop), which runs when the batch has
drained. Both are written by the engine's thread only: callers cancel through the engine
(``abort``), which turns the request's status at the next cycle boundary.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..config import DraftRecord, SMCConfig
from ..ends import FinishReason
from ..inference.program import SMCSDModel
from ..inference.state import Population
from ..results import RunStats

# Settings every row of one cycle shares: requests that differ in them run in separate batches.
# (A request's K and ``ignore_eos`` are its own: requests of other K and EOS share cycles.)
SHARED_SETTINGS = ("alpha", "cut", "cut_divergence")

_ids = itertools.count()


def new_id(prefix: str = "req") -> str:
    """A request id unique in this process."""
    return f"{prefix}-{next(_ids)}"


class RequestStatus(enum.Enum):
    """Where a request is: waiting for admission, running in the batch, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def shared_key(config: SMCConfig) -> tuple:
    """The settings a request shares with every request of its batch."""
    return tuple(getattr(config, k) for k in SHARED_SETTINGS)


class Reshape(Protocol):
    """A change of a request's population around each step, as LLaMPPL's ``smc_steer`` makes."""

    def before(self, pop: Population) -> Population:
        """The population the step runs (e.g. each particle as several children)."""

    def after(self, pop: Population) -> Population:
        """The population kept after the step (e.g. N of the children)."""


@dataclass(eq=False)
class Request:
    """One SMC-SD request as the engine holds it.

    Attributes:
        id: unique in the process; its population carries it.
        program: the program to run (the plain one for text generation).
        config: its settings.
        seed: its random stream's seed.
        stop: stop strings: its output ends before the first one.
        bounded: it counts against the queue bound (library calls wait however long).
        observer: called on the engine's thread after each of its cycles with the ``StepInfo``
            of that cycle narrowed to this request (streaming, progress, recording).
        arrival: when it was submitted (``time.perf_counter``).
        reshape: a ``Reshape`` applied to its population around each step (LLaMPPL's
            ``smc_steer``), or None.
        logprobs: give the target's log-probabilities of the output's tokens, with this many
            alternatives at each (``engine.scoring``); None: none.
        prompt_logprobs: the same for the prompt's tokens (the first has none); None: none.
        record: what is known of the draft before it runs (None: the pair's record).
        drafts: it drafts from its first cycle (the engine decides it on arrival).
        status: waiting, running or finished.
        cancelled: an abort reached the engine; it leaves at the next boundary.
        reason: why it finished (set once, by ``finish``).
        passed: times requests behind it joined a batch of other settings while it waited.
        forwards_from: the target's and the draft's forward seconds when it was admitted.
    """

    program: SMCSDModel
    config: SMCConfig
    seed: int
    stop: tuple[str, ...] = ()
    bounded: bool = True
    observer: Callable | None = None
    arrival: float = 0.0
    reshape: Reshape | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    record: DraftRecord | None = None
    drafts: bool = True
    id: str = field(default_factory=new_id)
    status: RequestStatus = RequestStatus.WAITING
    cancelled: bool = False
    reason: FinishReason | None = None
    passed: int = 0
    forwards_from: tuple[float, float] = (0.0, 0.0)

    @property
    def rows(self) -> int:
        """Rows it holds while running: particles times contexts."""
        return self.config.n_particles * len(self.program.contexts())

    @property
    def group(self) -> tuple:
        """The batch it can join: requests sharing ``SHARED_SETTINGS``."""
        return shared_key(self.config)

    def cost(self, pop: Population, tokens: int, forwards: tuple[float, float]) -> RunStats:
        """Its own cost: tokens, time since arrival, cycles, draft forwards and forward time.

        ``forwards``: the models' forward seconds now; its own are those since its admission.
        A cycle is one target call; its batch-mates share that call, the draft forwards and their time.
        """
        seconds = time.perf_counter() - self.arrival
        target, draft = (now - then for now, then in zip(forwards, self.forwards_from))
        return RunStats("smcsd", tokens, seconds, max(1, pop.cycles), pop.draft_calls, target, draft)


@dataclass(eq=False)
class Call:
    """Work that needs the pair's rows to itself (another method, a custom loop): ``fn()``, run alone.

    Attributes:
        fn: what to run; its return value is the call's result.
        id: unique in the process.
        status: waiting, then finished once it ran.
        cancelled: an abort reached the engine before it ran.
        reason: why it finished.
    """

    fn: Callable[[], object]
    id: str = field(default_factory=lambda: new_id("call"))
    bounded: bool = False
    status: RequestStatus = RequestStatus.WAITING
    cancelled: bool = False
    reason: FinishReason | None = None

    rows = 0
    group = None


def finish(work: Request | Call, reason: FinishReason) -> None:
    """The one way a request or call ends: its status and reason, set once."""
    if work.status is not RequestStatus.FINISHED:
        work.status, work.reason = RequestStatus.FINISHED, reason


Work = Request | Call

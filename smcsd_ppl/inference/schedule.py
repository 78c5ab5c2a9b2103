"""Adaptive drafting: how many tokens a request drafts next, learned from where its blocks were cut.

With the quality cut on (``SMCConfig.cut``), a block keeps its drafted tokens only while the
draft stays close to the target. Each request counts the drafted positions that passed the
cut and the cuts that fired, estimates the chance ``a`` that a position passes, and picks
the draft length L that maximizes the expected tokens per unit of cost:

    tokens(L) = 1 + a + a^2 + ... + a^L      (the kept prefix and the bonus token)
    cost(L)   = 1 + c L                      (one target step, L draft steps of relative cost c)

L = 0 is decoding with the target alone. A draft length depends only on earlier cycles,
so every block is still cut by a rule that sees its prefix only, and weights stay proper.

The plain program (no constraint, no conditions) needs one particle to probe and to decode
alone: the weights of a draft-free cycle are all equal, so more particles would buy nothing.

A pair remembers its draft across requests (``DraftRecord``): a request starts from what
earlier ones saw, so once the draft is known not to pay, requests decode alone from their
first token without even prefilling the draft, and every ``REPROBE_EVERY``-th such request
probes again (the draft may suit some prompts better than others).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

REPROBE_EVERY = 8  # requests that start alone between two probes
PRIOR_POSITIONS = 8.0  # how many drafted positions the record counts for in a new request
MEMORY = 0.8  # the record's counts decay by this factor per request

# Relative cost of one more verified position per drafted token: small on an accelerator,
# where the fused forward is memory-bound, larger on a CPU (docs/algorithm.md, the quality cut).
VERIFY_POSITION_COST = {"cpu": 0.1}
DEFAULT_POSITION_COST = 0.02


def draft_step_cost(draft_params: int | None, target_params: int | None, device_type: str) -> float:
    """Cost c of one drafted position relative to one target step, from the models' sizes.

    Decoding at small batch reads every weight once per forward, so a draft forward costs
    about its share of the parameters; the verify forward's extra position comes on top.
    Unknown sizes (test backends) count as a third of the target.
    """
    ratio = draft_params / target_params if draft_params and target_params else 1 / 3
    return ratio + VERIFY_POSITION_COST.get(device_type, DEFAULT_POSITION_COST)


def best_length(pass_rate: float, cost: float, longest: int) -> int:
    """The draft length in [0, longest] with the most expected tokens per unit of cost."""

    def value(n: int) -> float:
        return sum(pass_rate**j for j in range(n + 1)) / (1 + cost * n)

    return max(range(longest + 1), key=value)


@dataclass
class DraftRecord:
    """A pair's memory of its draft: cut counts pooled over requests, older ones fading."""

    passed: float = 0.0
    failed: float = 0.0
    alone_since_probe: int = 0
    frozen: bool = False  # stop learning: every request then starts alike, whatever ran before

    def schedule(self, block_size: int, particles: int, plain: bool, cost: float) -> DraftSchedule:
        """A new request's schedule, starting from this record (or probing afresh)."""
        seen = self.passed + self.failed
        fresh = DraftSchedule(block_size, particles, plain, cost)
        if not seen:
            return fresh
        scale = min(1.0, PRIOR_POSITIONS / seen)
        prior = DraftSchedule(block_size, particles, plain, cost, self.passed * scale, self.failed * scale)
        if prior.planned_length() > 0 or self.frozen:
            return prior
        self.alone_since_probe += 1
        if self.alone_since_probe > REPROBE_EVERY:
            self.alone_since_probe = 0
            return fresh
        return prior

    def update(self, schedule: DraftSchedule) -> None:
        """Add what a finished request's own cycles saw (unless frozen)."""
        if self.frozen:
            return
        self.passed = MEMORY * self.passed + schedule.passed - schedule.prior_passed
        self.failed = MEMORY * self.failed + schedule.failed - schedule.prior_failed


@dataclass
class DraftSchedule:
    """One request's draft length and particle count, cycle by cycle.

    Attributes:
        block_size: K, the longest block.
        particles: N, the particle count while drafting.
        plain: the request runs the plain program, so it may probe and decode alone with
            one particle.
        cost: c, one drafted position's cost relative to one target step.
        passed: drafted positions kept by the cut so far (the record's share included).
        failed: cuts that fired so far (likewise).
        lengths: the draft length of each cycle run (0: the target alone).
    """

    block_size: int
    particles: int
    plain: bool
    cost: float
    passed: float = 0.0
    failed: float = 0.0
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prior_passed, self.prior_failed = self.passed, self.failed

    @property
    def alone(self) -> bool:
        """The request decodes with the target alone from now on (drafting did not pay)."""
        return bool(self.lengths) and self.lengths[-1] == 0

    @property
    def probing(self) -> bool:
        """The request has seen no cut yet, nor any record: it drafts half a block to learn."""
        return self.passed + self.failed == 0

    def planned_length(self) -> int:
        """The draft length the evidence so far calls for."""
        if self.alone:  # no drafting, no new evidence: stay
            return 0
        if self.probing:
            return max(1, self.block_size // 2)
        return best_length(self.passed / (self.passed + self.failed), self.cost, self.block_size)

    def next_length(self) -> int:
        """The next cycle's draft length (and record it)."""
        self.lengths.append(self.planned_length())
        return self.lengths[-1]

    def n_particles(self) -> int:
        """How many particles the next cycle should run (after ``next_length``)."""
        first_probe = len(self.lengths) == 1 and self.prior_passed + self.prior_failed == 0
        return 1 if self.plain and (first_probe or self.alone) else self.particles

    def observe(self, kept: Sequence[int], diverged: Sequence[bool]) -> None:
        """Count one cycle's blocks: tokens kept by the cut, and whether it fired."""
        self.passed += sum(kept)
        self.failed += sum(diverged)

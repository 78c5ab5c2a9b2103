"""Adaptive drafting: how many tokens a request drafts next, learned from where its blocks were cut.

With the quality cut on (``SMCConfig.cut``), a block keeps its drafted tokens only while the
draft stays close to the target. Each request counts the drafted positions that passed the
cut and the cuts that fired, estimates the chance ``a`` that a position passes, and picks
the draft length L that maximizes the expected tokens per unit of cost:

    tokens(L) = 1 + a + a^2 + ... + a^L      (the kept prefix and the bonus token)
    cost(L)   = 1 + c L                      (one target step, L draft steps of relative cost c)

L = 0 is decoding with the target alone. A draft length depends only on earlier cycles,
so every block is still cut by a rule that sees its prefix only, and weights stay proper.

The plain program (no constraint, no conditions, alpha = 1) decodes alone with one
particle: the weights of a draft-free cycle are then all equal, so more particles would buy
nothing. Every other request keeps its N particles throughout, and a plain request probes
with all N (a probe's kept tokens carry weights like any block's).

A request starts from a ``DraftRecord``: what is known of the draft beforehand (none: it
probes). The record is a value the caller passes in, never state a request changes, so the
same call gives the same output whatever ran before; a finished request's evidence can be
folded into a new record (``learned``) by a caller who wants requests to learn.
Once a record says the draft does not pay, requests decode alone from their first token
without even prefilling the draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..config import DraftRecord

PRIOR_POSITIONS = 8.0  # how many drafted positions a record counts for in a new request
MEMORY = 0.8  # a learned record keeps this share of its older evidence

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


def schedule_from(
    record: DraftRecord, block_size: int, particles: int, plain: bool, cost: float
) -> DraftSchedule:
    """A new request's schedule, starting from ``record`` (probing when it is empty)."""
    seen = record.passed + record.failed
    scale = min(1.0, PRIOR_POSITIONS / seen) if seen else 0.0
    passed, failed = record.passed * scale, record.failed * scale
    return DraftSchedule(block_size, particles, plain, cost, passed, failed, passed, failed)


def learned(record: DraftRecord, schedule: DraftSchedule) -> DraftRecord:
    """``record`` with a finished request's own evidence added, older evidence fading."""
    return DraftRecord(
        MEMORY * record.passed + schedule.passed - schedule.prior_passed,
        MEMORY * record.failed + schedule.failed - schedule.prior_failed,
    )


@dataclass(frozen=True)
class DraftSchedule:
    """One request's draft length and particle count, cycle by cycle (a value: changes return new ones).

    Attributes:
        block_size: K, the longest block.
        particles: N, the particle count while drafting.
        plain: the request runs the plain program at alpha = 1, so it may decode alone with
            one particle.
        cost: c, one drafted position's cost relative to one target step.
        passed: drafted positions kept by the cut so far (the record's share included).
        failed: cuts that fired so far (likewise).
        prior_passed: the record's share of ``passed``.
        prior_failed: the record's share of ``failed``.
        lengths: the draft length of each cycle run (0: the target alone).
    """

    block_size: int
    particles: int
    plain: bool
    cost: float
    passed: float = 0.0
    failed: float = 0.0
    prior_passed: float = 0.0
    prior_failed: float = 0.0
    lengths: tuple[int, ...] = ()

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

    def advanced(self) -> DraftSchedule:
        """The schedule with the next cycle's draft length decided."""
        return replace(self, lengths=(*self.lengths, self.planned_length()))

    @property
    def length(self) -> int:
        """The current cycle's draft length."""
        return self.lengths[-1]

    def n_particles(self) -> int:
        """How many particles the current cycle runs."""
        return 1 if self.plain and self.alone else self.particles

    def observed(self, kept: Sequence[int], diverged: Sequence[bool]) -> DraftSchedule:
        """The schedule after one cycle's drafted blocks: tokens kept by the cut, and whether it fired."""
        return replace(self, passed=self.passed + sum(kept), failed=self.failed + sum(diverged))

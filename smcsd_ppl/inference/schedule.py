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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Relative cost of one more verified position per drafted token: small on an accelerator,
# where the fused forward is memory-bound, about a tenth of a step on a CPU (MODELS.md).
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
class DraftSchedule:
    """One request's draft length and particle count, cycle by cycle.

    Attributes:
        block_size: K, the longest block.
        particles: N, the particle count while drafting.
        plain: the request runs the plain program, so it may probe and decode alone with
            one particle.
        cost: c, one drafted position's cost relative to one target step.
        passed: drafted positions kept by the cut so far.
        failed: cuts that fired so far.
        lengths: the draft length of each cycle run (0: the target alone).
    """

    block_size: int
    particles: int
    plain: bool
    cost: float
    passed: int = 0
    failed: int = 0
    lengths: list[int] = field(default_factory=list)

    @property
    def alone(self) -> bool:
        """The request decodes with the target alone from now on (drafting did not pay)."""
        return bool(self.lengths) and self.lengths[-1] == 0

    def next_length(self) -> int:
        """The next cycle's draft length (and record it)."""
        if not self.lengths:  # no evidence yet: a probe of half a block
            n = max(1, self.block_size // 2)
        elif self.alone:  # no drafting, no new evidence: stay
            n = 0
        else:
            seen = self.passed + self.failed
            rate = self.passed / seen if seen else 1.0
            n = best_length(rate, self.cost, self.block_size)
        self.lengths.append(n)
        return n

    def n_particles(self) -> int:
        """How many particles the next cycle should run."""
        if self.plain and (len(self.lengths) <= 1 or self.alone):
            return 1
        return self.particles

    def observe(self, kept: Sequence[int], diverged: Sequence[bool]) -> None:
        """Count one cycle's blocks: tokens kept by the cut, and whether it fired."""
        self.passed += sum(kept)
        self.failed += sum(diverged)

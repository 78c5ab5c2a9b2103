"""The blocks a cycle drafts and scores, and the hard constraint on a row's next block."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..potentials.constraints import Constraint

CONSTRAINT_MODES = ("proposal", "critic")


@dataclass(frozen=True)
class RowConstraint:
    """A hard constraint on one particle's next block.

    Attributes:
        constraint: answers ``next_mask(contexts)`` (see ``smcsd_ppl.potentials``).
        mode: ``"proposal"``: the draft samples only allowed tokens (q masked and
            renormalized); ``"critic"``: the draft samples freely and a block with an
            impossible token is cut before it and gets zero weight.
        context: the tokens the particle has generated so far.
    """

    constraint: Constraint
    mode: str
    context: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.mode not in CONSTRAINT_MODES:
            raise ValueError(f"constraint mode must be one of {CONSTRAINT_MODES}, got {self.mode!r}")


@dataclass
class DraftedBlock:
    """The tokens drafted for one row in a cycle, and how many of them count."""

    row: int
    tokens: list[int]  # all drafted tokens: K, or fewer when every row of the call ended sooner
    draft_logq: torch.Tensor  # [k] log q(d_j | .) at T_d
    kept: int  # tokens that count: an EOS (included) or the budget cuts the rest
    stops: bool  # the block itself ends the particle (drafted EOS or budget): no bonus
    budget: int  # tokens the particle could still emit before this block
    draft_probs: torch.Tensor | None = None  # [k, V] q at each drafted position, on request
    constraint: RowConstraint | None = None
    dead: bool = False  # the constraint allowed nothing where the block ends: zero weight
    fed: int = 0  # drafted tokens the draft model has read (k-1, fewer after forced tokens)
    diverged: bool = False  # the quality cut ended the block (``SMCConfig.cut``)

    @property
    def kept_tokens(self) -> list[int]:
        """The drafted tokens that count."""
        return self.tokens[: self.kept]

    @property
    def log_q(self) -> float:
        """Log-density of the kept tokens under the proposal."""
        return float(self.draft_logq[: self.kept].sum())


@dataclass
class ScoredBlock:
    """A drafted block after the target's fused forward."""

    drafted: DraftedBlock
    target_logp: torch.Tensor  # [K] alpha-free log p_T(d_j | .)
    bonus: int | None  # token drawn from the target after the kept prefix
    stops: bool  # the particle ends here: the block stopped, the bonus is EOS, or the budget is spent
    bonus_log_z: float  # log sum_v p_T(v)^alpha at the bonus position (0 if alpha = 1)
    log_weight: float  # the SMC-SD increment: sum over kept of (alpha log p - log q) + bonus_log_z


def block_length(blocks: Sequence[DraftedBlock]) -> int:
    """The common length of blocks drafted in one ``draft_blocks`` call."""
    lengths = {len(b.tokens) for b in blocks}
    if len(lengths) != 1:
        raise ValueError(f"blocks verified together must be drafted together (lengths {sorted(lengths)})")
    return lengths.pop()


@dataclass
class FirstToken:
    """The empty block before x0, so the first token is drawn like a constrained bonus."""

    constraint: RowConstraint | None
    stops: bool = False
    kept_tokens: tuple = ()

"""The records a cycle passes along: block requests, drafted blocks, scored blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..potentials.constraints import Constraint
from ..proposals.blocks import RowProposal

CONSTRAINT_MODES = ("proposal", "critic")


def check_constraint(constraint: object) -> None:
    """Raise a one-line ``ValueError`` unless ``constraint`` is a ``Constraint`` (or None)."""
    if constraint is not None and not isinstance(constraint, Constraint):
        raise ValueError(
            f"a constraint must be a smcsd_ppl.potentials.Constraint, got {type(constraint).__name__}: "
            "build one (RegexConstraint(pattern, pair.tokenizer, pair.eos_token_ids), "
            "JsonSchemaConstraint(schema, ...)) or subclass Constraint"
        )


@dataclass(frozen=True)
class RowConstraint:
    """A hard constraint on one particle's next block.

    Attributes:
        constraint: answers ``next_mask(contexts)`` (see ``smcsd_ppl.potentials``).
        mode: ``"proposal"``: the draft samples only allowed tokens (q masked and
            renormalized); ``"critic"``: the draft samples freely and a block with an
            impossible token is cut before it and gets zero weight.
        context: the tokens the particle has generated so far.
        lookahead: also estimate the future validity of the block's end (``ScoredBlock.log_future``).
        structure: estimate it through the finite structure after the end, not one token
            (``inference.structure``).
        finite: read that structure only where it is finite, every path it follows ending the
            output or running past the read's budget; where it opens into free text, no twist.
        tilt: the last block's structure read (``structure.Tilts``): for each path it followed
            from the context, (token, log Phi-hat after it); the lead is drawn tilted by the
            empty path's, the tokens drafted after it by their path's (None: not read there).
    """

    constraint: Constraint
    mode: str
    context: tuple[int, ...]
    lookahead: bool = False
    structure: bool = False
    tilt: dict | None = None
    finite: bool = False

    def __post_init__(self) -> None:
        check_constraint(self.constraint)
        if self.mode not in CONSTRAINT_MODES:
            raise ValueError(f"constraint mode must be one of {CONSTRAINT_MODES}, got {self.mode!r}")


@dataclass(frozen=True)
class BlockRequest:
    """What one particle's ``extend()`` asks of the cycle: a block on one of its contexts' rows.

    Attributes:
        row: the context's row in the row store.
        budget: tokens the context may still emit.
        constraint: a hard constraint on the block, or None.
        unsent: tokens the context appended since its last request (the row reads them first).
        mask: ``[V]`` bool, what the context's next token may be (a ``mask_dist`` observation),
            or None: it applies to the block's lead token.
        limit: how many drafted tokens may count (0: the row does not draft; None: the
            call's block size).
        proposal: what draws the block (None: the draft model).
    """

    row: int
    budget: int
    constraint: RowConstraint | None = None
    unsent: tuple[int, ...] = ()
    mask: torch.Tensor | None = None
    limit: int | None = None
    proposal: RowProposal | None = None


@dataclass(frozen=True)
class TokenRequest:
    """A token-level step's request: the target's next-token distribution on a context's row.

    Attributes:
        row: the context's row.
        unsent: tokens the context appended since its last request (the row reads them first).
        temperature: the context's own temperature (None: the run's target temperature).
    """

    row: int
    unsent: tuple[int, ...] = ()
    temperature: float | None = None


@dataclass
class DraftedBlock:
    """The tokens drafted for one row in a cycle, and how many of them may count."""

    row: int
    tokens: list[int]  # all drafted tokens: k, or fewer when every row of the call ended sooner
    draft_logq: torch.Tensor  # [k] log q(d_j | .) at T_d (masked q where a constraint restricts)
    limit: int  # tokens that may count: an EOS (included), the budget, the draft length or a dead end
    stops: bool  # the block itself ends the particle (drafted EOS or budget): no bonus
    budget: int  # tokens the particle could still emit before this block
    draft_probs: torch.Tensor | None = None  # [k, V] q at each drafted position, on request
    constraint: RowConstraint | None = None
    dead: bool = False  # the constraint allowed nothing where the block ends: zero weight
    fed: int = 0  # drafted tokens the draft model has read (k-1, fewer after forced tokens)
    allowed: list[torch.Tensor] = field(default_factory=list)  # [V] per position: a proposal mask
    checks: list[float] | None = None  # a retrieval row: the uniform the target checks each token with

    @property
    def countable(self) -> list[int]:
        """The drafted tokens that may count (up to ``limit``)."""
        return self.tokens[: self.limit]


@dataclass(frozen=True)
class ScoredBlock:
    """One row's block after verification: what its particle keeps and the weight it earns.

    Attributes:
        row: the row it was drafted on.
        lead: the token drawn from the target before drafting, when the row had nothing
            queued (a context's first block, or one after a ``mask_dist`` observation).
        drafted: every drafted token (the cut, an EOS or the budget may keep fewer).
        kept: drafted tokens kept.
        bonus: the token drawn from the target after them (None: the particle ends).
        log_weight: the SMC-SD log-weight increment (-inf: the particle dies).
        stops: the particle ends here (an EOS, the budget, a dead end).
        dead: a constraint allowed nothing where the block ended.
        diverged: the quality cut ended the block.
        log_future: the estimate of log Phi at the block's end, where its constraint asked
            for it (``RowConstraint.lookahead``) and the particle goes on.
        tilt: the structure read's tilts from the block's end (``structure.Tilts``;
            ``RowConstraint.tilt`` of the particle's next block; None: not read).
    """

    row: int
    lead: int | None
    drafted: tuple[int, ...]
    kept: int
    bonus: int | None
    log_weight: float
    stops: bool
    dead: bool = False
    diverged: bool = False
    log_future: float | None = None
    tilt: dict | None = None

    @property
    def tokens(self) -> list[int]:
        """The tokens the context emits: the lead, the kept drafted tokens, then the bonus."""
        lead = [] if self.lead is None else [self.lead]
        return lead + list(self.drafted[: self.kept]) + ([] if self.bonus is None else [self.bonus])


CycleRequest = BlockRequest | TokenRequest
"""What a particle's step asks of its cycle: a block, or a row's next-token distribution."""

CycleAnswer = ScoredBlock | torch.Tensor
"""What it gets back: its ``ScoredBlock``, or the row's next-token log-probabilities ``[V]``."""


def block_length(blocks: Sequence[DraftedBlock]) -> int:
    """The common length of blocks drafted in one ``draft_blocks`` call."""
    lengths = {len(b.tokens) for b in blocks}
    if len(lengths) != 1:
        raise ValueError(f"blocks verified together must be drafted together (lengths {sorted(lengths)})")
    return lengths.pop()

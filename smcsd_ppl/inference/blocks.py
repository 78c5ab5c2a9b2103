"""The records a cycle passes along: block requests, drafted blocks, scored blocks."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import torch

from ..ends import first_end
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
        block_size: its request's K, the most it drafts (0: the call's).
        stops_at_eos: an EOS ends it (False: its request ignores EOS).
    """

    row: int
    budget: int
    constraint: RowConstraint | None = None
    unsent: tuple[int, ...] = ()
    mask: torch.Tensor | None = None
    limit: int | None = None
    proposal: RowProposal | None = None
    block_size: int = 0
    stops_at_eos: bool = True


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


class DraftBatch:
    """What one drafting call drew for every backend row, on the device until the host needs it.

    A cycle without constraints reads the tokens with its verdict, in one read; where a step
    needs them on the host before (a constraint's masks and factors, exact SD), ``host``
    reads them then, once for the call.

    Args:
        tokens: ``[R, k]`` the tokens drawn per backend row (rows not asked hold unread values).
        logq: ``[R, k]`` log q of each (masked q where a constraint restricts).
        probs: ``[R, k, V]`` q at each position, where kept (the cut, a retrieval row).
    """

    def __init__(self, tokens: torch.Tensor, logq: torch.Tensor, probs: torch.Tensor | None = None) -> None:
        self.tokens, self.logq, self.probs = tokens, logq, probs
        self._host: list[list[int]] | None = None

    @property
    def k(self) -> int:
        """Tokens drafted per row."""
        return self.tokens.shape[1]

    def host(self) -> list[list[int]]:
        """The tokens per backend row on the host (read from the device at most once)."""
        if self._host is None:
            self._host = self.tokens.cpu().tolist()
        return self._host

    def known(self, rows: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """The tokens of ``rows``, read with something else: no read of their own is needed."""
        if self._host is None:
            self._host = [[] for _ in range(len(self.tokens))]
        for r, t in zip(rows, tokens):
            self._host[r] = list(t)


@dataclass
class DraftedBlock:
    """One row's block of a drafting call: where it may end (on the host) and its tokens (in the batch).

    The tokens, and where an EOS or the budget ends the block among them, live on the device
    (``DraftBatch``; verification reads ``ending``); the fields below them read the host's copy.
    """

    row: int
    batch: DraftBatch
    reach: int  # drafted tokens that may count at most: the row's draft length, or where drafting ended it
    budget: int  # tokens the particle could still emit before this block
    constraint: RowConstraint | None = None
    dead_at: int | None = None  # the position where the constraint allowed nothing (the row dies there)
    fed: int = 0  # drafted tokens the draft model has read (k-1, fewer after forced tokens)
    allowed: list[torch.Tensor] = field(default_factory=list)  # [V] per position: a proposal mask
    checks: list[float] | None = None  # a retrieval row: the uniform the target checks each token with
    eos: frozenset[int] = frozenset()  # the EOS ids in force
    drawn_at: tuple[int, ...] = ()  # positions a draft forward drew for this row (none: retrieved, forced)

    @property
    def feed(self) -> int:
        """Drafted tokens the target reads: all that may count (an EOS among them is found on the device)."""
        dead_at = self.batch.k if self.dead_at is None else self.dead_at
        return min(self.batch.k, self.reach, self.budget, dead_at)

    def forwards_until_end(self, tokens: Sequence[int]) -> int:
        """The draft forwards that drew this row's ``tokens`` up to where its block ends.

        Forwards that batch-mates still drafting ran past that are not the request's: its
        count is the same whoever shares the call.
        """
        counts, _, dead = block_ending(tokens, self.reach, self.budget, self.dead_at, self.eos)
        return sum(j < counts + dead for j in self.drawn_at)  # a dead end's forward found it

    @property
    def tokens(self) -> list[int]:
        """Every drafted token (on the host)."""
        return self.batch.host()[self.row]

    @property
    def draft_logq(self) -> torch.Tensor:
        """``[k]`` log q(d_j | .) at T_d (masked q where a constraint restricts)."""
        return self.batch.logq[self.row]

    @property
    def draft_probs(self) -> torch.Tensor | None:
        """``[k, V]`` q at each drafted position, where kept."""
        return None if self.batch.probs is None else self.batch.probs[self.row]

    @property
    def limit(self) -> int:
        """Tokens that may count: an EOS (included), the budget, the draft length or a dead end."""
        return self.ending[0]

    @property
    def stops(self) -> bool:
        """The block itself ends the particle (drafted EOS or budget): no bonus."""
        return self.ending[1]

    @property
    def dead(self) -> bool:
        """The constraint allowed nothing where the block ends: zero weight."""
        return self.ending[2]

    @property
    def ending(self) -> tuple[int, bool, bool]:
        """(limit, stops, dead) by ``block_ending`` over the host's tokens."""
        return block_ending(self.tokens, self.reach, self.budget, self.dead_at, self.eos)

    @property
    def countable(self) -> list[int]:
        """The drafted tokens that may count (up to ``limit``)."""
        return self.tokens[: self.limit]


def block_ending(
    tokens: Sequence[int], reach: int, budget: int, dead_at: int | None, eos: Container[int]
) -> tuple[int, bool, bool]:
    """Where a block ends among its ``tokens``: (tokens that count, it ends the particle, it dies).

    It ends at its ``reach`` (its draft length, or where drafting ended it), where its
    constraint allowed nothing (``dead_at``: it dies there unless an EOS or the budget ended it
    first), the first EOS (kept), or the budget. ``device_ending`` is the same rule on the device.
    """
    end = min(len(tokens), reach, len(tokens) if dead_at is None else dead_at)
    stop = first_end(tokens[:end], 0, budget, eos)
    counts, stops = (min(end, budget), False) if stop is None else (stop, True)
    dead = not stops and dead_at is not None and counts == dead_at < min(len(tokens), reach)
    return counts, stops, dead


def device_ending(
    tokens: torch.Tensor,  # [n, k]
    reach: torch.Tensor,  # [n]
    budget: torch.Tensor,  # [n]
    dead_at: torch.Tensor,  # [n] k + 1 where the constraint allowed every position
    eos: torch.Tensor,  # [E] (an id outside the vocabulary where none)
    stops_at_eos: torch.Tensor,  # [n] bool: the row's request ends at EOS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``block_ending`` for a batch, on the tokens' device: no host read."""
    k = tokens.shape[1]
    reach = reach.clamp(max=k)
    end = torch.minimum(reach, dead_at)
    position = torch.arange(1, k + 1, device=tokens.device)[None, :]
    eos_at = torch.isin(tokens, eos) & stops_at_eos[:, None]
    ends = (eos_at | (position >= budget[:, None])) & (position <= end[:, None])
    stops = ends.any(1)
    before = (~ends).long().cumprod(1).sum(1)  # positions before the first end (any k, 0 included)
    counts = torch.where(stops, before + 1, torch.minimum(end, budget))
    dead = ~stops & (counts == dead_at) & (dead_at < reach)
    return counts, stops, dead


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
        fault: what the engine did wrong on this row (NaN logits), where it did: the request
            fails with ``backends.base.NonFiniteLogits``; its batch-mates go on.
        draft_forwards: the draft forwards that drew the block (the request's cost).
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
    fault: str = ""
    draft_forwards: int = 0

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
    if len({id(b.batch) for b in blocks}) != 1:
        raise ValueError("blocks verified together must be drafted together, in one call")
    return blocks[0].batch.k

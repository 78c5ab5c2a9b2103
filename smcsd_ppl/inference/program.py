"""SMC-SD programs: LLaMPPL models whose proposal is the draft LM and whose potential is the target.

A user subclasses ``SMCSDModel`` and writes ``async def step(self)`` as in LLaMPPL.
``await self.extend()`` proposes a block of K tokens from the draft, scores it with
the target in the run's one fused forward, and adds the SMC-SD weight::

    class Generate(SMCSDModel):
        async def step(self):
            await self.extend()

Particles are light: their KV state lives in row ``self.row`` of the batched backends.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llamppl import Model
from llamppl.distributions import Distribution

from ..potentials.constraints import Constraint
from .blocks import DraftedBlock, RowConstraint, ScoredBlock
from .engine import BlockEngine


class CycleBarrier:
    """Gathers the requests of all stepping particles into one batched call.

    A batch runs when every particle still stepping has asked (or returned), so the
    synchronization is explicit, not a timer. ``handlers`` map a request kind to a
    function from a list of items to a list of results.
    """

    def __init__(self, handlers: dict[str, Callable[[list], list]]) -> None:
        self.handlers = handlers
        self.active = 0
        self.pending: list[tuple[str, Any, asyncio.Future]] = []

    def open(self, n_active: int) -> None:
        """Start a cycle with ``n_active`` stepping particles."""
        self.active, self.pending = n_active, []

    async def submit(self, kind: str, item: Any) -> Any:
        """Queue a request; resolves when its batch has run."""
        future = asyncio.get_running_loop().create_future()
        self.pending.append((kind, item, future))
        self._maybe_flush()
        return await future

    def leave(self) -> None:
        """A particle finished its step (it will ask for nothing more this cycle)."""
        self.active -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if not self.pending or len(self.pending) < self.active:
            return
        batch, self.pending = self.pending, []
        for kind in dict.fromkeys(k for k, _, _ in batch):
            group = [(item, fut) for k, item, fut in batch if k == kind]
            try:
                results = self.handlers[kind]([item for item, _ in group])
            except Exception as err:  # every waiting particle sees the failure
                for _, fut in group:
                    fut.set_exception(err)
                continue
            for (_, fut), result in zip(group, results):
                fut.set_result(result)


@dataclass
class Runtime:
    """What a run shares with all its particles (never copied on resampling)."""

    engine: BlockEngine
    barrier: CycleBarrier
    max_new_tokens: int
    decode: Callable[[Sequence[int]], str]


class SMCSDModel(Model):
    """Base class of SMC-SD programs (a ``llamppl.Model``).

    Args:
        prompt: text (tokenized with the target's tokenizer, chat template applied
            for instruct models) or a list of token ids.
        constraint: a hard constraint every output must satisfy (also applied to the
            first token, drawn before any block), used by ``extend()`` by default.
        mode: how ``extend()`` applies it: ``"proposal"`` or ``"critic"``.

    Attributes:
        token_ids: tokens generated so far (the first is x0, drawn from the target).
        row: this particle's row in the batched backends.
        last_block: the ``ScoredBlock`` of the latest ``extend()``.
    """

    def __init__(
        self, prompt: str | Sequence[int], constraint: Constraint | None = None, mode: str = "proposal"
    ) -> None:
        super().__init__()
        self.prompt = prompt
        self.constraint, self.mode = constraint, mode
        self.token_ids: list[int] = []
        self.row = -1
        self.draft_limit: int | None = None  # this cycle's draft length, when the run adapts it
        self.last_block: ScoredBlock | None = None
        self.runtime: Runtime | None = None

    def immutable_properties(self) -> set[str]:
        """Attributes shared, not copied, on resampling."""
        return {"prompt", "runtime"}

    def __deepcopy__(self, memo: dict) -> SMCSDModel:
        # The runtime (backends, engine) is shared by every particle, whatever a
        # subclass declares immutable: resampling must never copy model state.
        # Blocks are read-only records: share them too.
        for shared in (self.runtime, self.last_block):
            memo[id(shared)] = shared
        for value in self.__dict__.values():  # constraints hold large tables; never copy them
            if isinstance(value, Constraint):
                memo[id(value)] = value
        return super().__deepcopy__(memo)

    async def step(self) -> None:
        """The default program: plain SMC-SD generation."""
        await self.extend()

    async def extend(self, constraint: Constraint | None = None, mode: str | None = None) -> ScoredBlock:
        """Draft K tokens, score them with the target, weight, and commit them with the bonus.

        Args:
            constraint: a hard constraint on the output (``smcsd_ppl.potentials``); the
                target becomes p^alpha x constraint. Defaults to ``self.constraint``.
            mode: ``"proposal"`` (the draft samples only allowed tokens) or ``"critic"``
                (the block is cut before its first impossible token). Defaults to ``self.mode``.

        Finishes the particle at an EOS token (drafted or bonus), when
        ``max_new_tokens`` is reached, or when the constraint allows nothing more.
        """
        constraint = self.constraint if constraint is None else constraint
        await self.sample(self.target_block(), proposal=self.draft_block(constraint, mode or self.mode))
        if self.last_block.stops:
            self.finish()
        return self.last_block

    def draft_block(self, constraint: Constraint | None = None, mode: str = "proposal") -> DraftBlock:
        """The proposal: K tokens from the draft model (optionally constrained)."""
        row_constraint = (
            None if constraint is None else RowConstraint(constraint, mode, tuple(self.token_ids))
        )
        return DraftBlock(self, row_constraint)

    def target_block(self) -> TargetBlock:
        """The potential: the target's (power) probability of a drafted block."""
        return TargetBlock(self)

    @property
    def plain(self) -> bool:
        """Whether this is the plain program: unconstrained generation, no user ``step``."""
        return type(self).step is SMCSDModel.step and self.constraint is None

    @property
    def budget(self) -> int:
        """How many more tokens this particle may emit."""
        return self.runtime.max_new_tokens - len(self.token_ids)

    @property
    def text(self) -> str:
        """The generated text so far."""
        return self.runtime.decode(self.token_ids)

    def __str__(self) -> str:
        return self.text if self.runtime else f"SMCSDModel({self.prompt!r})"


class DraftBlock(Distribution):
    """K tokens drafted for one particle, batched with every other particle of the cycle."""

    def __init__(self, particle: SMCSDModel, constraint: RowConstraint | None = None) -> None:
        self.particle, self.constraint = particle, constraint

    async def sample(self) -> tuple[DraftedBlock, float]:
        """Draft a block; returns it with its log q."""
        if self.particle.finished:
            raise ValueError("a finished particle cannot draft")
        p = self.particle
        block = await p.runtime.barrier.submit("draft", (p.row, p.budget, self.constraint, p.draft_limit))
        return block, block.log_q

    async def log_prob(self, block: DraftedBlock) -> float:
        """Log q of the block."""
        return block.log_q


class TargetBlock(Distribution):
    """The target's score of a drafted block, from the cycle's one fused forward.

    Scoring also draws the bonus token from the target at the position after the
    kept prefix and commits the block: the result is
    ``alpha * sum log p_T(d_j) + log Z_bonus``.
    """

    def __init__(self, particle: SMCSDModel) -> None:
        self.particle = particle

    async def log_prob(self, block: DraftedBlock) -> float:
        """Score the block with the target (batched); commits it and its bonus token."""
        p = self.particle
        scored: ScoredBlock = await p.runtime.barrier.submit("target", block)
        p.token_ids.extend(scored.drafted.kept_tokens)  # the quality cut may keep fewer than drafted
        if scored.bonus is not None:
            p.token_ids.append(scored.bonus)
        p.last_block = scored
        if scored.drafted.dead:  # the constraint allowed nothing: zero weight
            return -math.inf
        # LLaMPPL's sample() subtracts the log q that DraftBlock.sample returned (before
        # any cut); hand back the potential's part relative to it.
        return scored.log_weight + block.log_q

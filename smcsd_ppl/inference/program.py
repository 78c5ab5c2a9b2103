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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llamppl import Model

from ..potentials.constraints import Constraint
from .blocks import BlockRequest, RowConstraint, ScoredBlock, check_constraint


class CycleBarrier:
    """Gathers the block requests of all stepping particles into one batched call.

    A batch runs when every particle still stepping has asked (or returned from its step),
    so the synchronization is explicit, not a timer. Each cycle opens the barrier with the
    handler that serves its batches: a function from requests to their results.
    """

    def __init__(self) -> None:
        self.active = 0
        self.handler: Callable[[list], list] | None = None
        self.pending: list[tuple[Any, asyncio.Future]] = []
        self.served = 0  # requests served since the cycle opened

    def open(self, n_active: int, handler: Callable[[list], list]) -> None:
        """Start a cycle with ``n_active`` stepping particles, served by ``handler``."""
        self.active, self.handler, self.pending, self.served = n_active, handler, [], 0

    async def submit(self, item: Any) -> Any:
        """Queue a request; resolves when its batch has run."""
        future = asyncio.get_running_loop().create_future()
        self.pending.append((item, future))
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
        self.served += len(batch)
        try:
            results = self.handler([item for item, _ in batch])
        except Exception as err:  # every waiting particle sees the failure
            for _, fut in batch:
                fut.set_exception(err)
            return
        for (_, fut), result in zip(batch, results):
            fut.set_result(result)


@dataclass
class Runtime:
    """What a run shares with all its particles (never copied on resampling)."""

    barrier: CycleBarrier
    max_new_tokens: int
    decode: Callable[[Sequence[int]], str]
    eos: frozenset[int]


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
        check_constraint(constraint)
        self.prompt = prompt
        self.constraint, self.mode = constraint, mode
        self.token_ids: list[int] = []
        self.row = -1
        self.last_block: ScoredBlock | None = None
        self.runtime: Runtime | None = None

    def immutable_properties(self) -> set[str]:
        """Attributes shared, not copied, on resampling."""
        return {"prompt", "runtime"}

    def __deepcopy__(self, memo: dict) -> SMCSDModel:
        # The runtime (the cycle's barrier) is shared by every particle, whatever a
        # subclass declares immutable. Blocks are read-only records: share them too.
        for shared in (self.runtime, self.last_block):
            memo[id(shared)] = shared
        for value in self.__dict__.values():  # constraints hold parser states; never copy them
            if isinstance(value, Constraint):
                memo[id(value)] = value
        return super().__deepcopy__(memo)

    async def step(self) -> None:
        """The default program: plain SMC-SD generation."""
        await self.extend()

    async def extend(self, constraint: Constraint | None = None, mode: str | None = None) -> ScoredBlock:
        """Draft up to K tokens, score them with the target, weight, and commit them with the bonus.

        The block is one request to the cycle's batched call (every particle's blocks are
        drafted together and scored in one fused target forward); its SMC-SD log-weight
        enters through LLaMPPL's ``score``.

        Args:
            constraint: a hard constraint on the output (``smcsd_ppl.potentials``); the
                target becomes p^alpha x constraint. Defaults to ``self.constraint``.
            mode: ``"proposal"`` (the draft samples only allowed tokens) or ``"critic"``
                (the block is cut before its first impossible token). Defaults to ``self.mode``.

        Finishes the particle at an EOS token (drafted or bonus), when
        ``max_new_tokens`` is reached, or when the constraint allows nothing more.
        """
        if self.finished:
            raise ValueError("a finished particle cannot extend")
        constraint = self.constraint if constraint is None else constraint
        row_constraint = (
            None
            if constraint is None
            else RowConstraint(constraint, mode or self.mode, tuple(self.token_ids))
        )
        block: ScoredBlock = await self.runtime.barrier.submit(
            BlockRequest(self.row, self.budget, row_constraint)
        )
        self.token_ids.extend(block.tokens)
        self.last_block = block
        self.score(block.log_weight)
        if block.stops:
            self.finish()
        return block

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

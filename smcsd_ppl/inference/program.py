"""SMC-SD programs: LLaMPPL models whose proposal is the draft LM and whose potential is the target.

A user subclasses ``SMCSDModel`` and writes ``async def step(self)`` as in LLaMPPL.
``await self.extend()`` proposes a block of K tokens from the draft, scores it with
the target in the run's one fused forward, and adds the SMC-SD weight::

    class Generate(SMCSDModel):
        async def step(self):
            await self.extend()

A program may also take LLaMPPL's token-level steps on its contexts
(``await self.sample(self.context.next_token())``, ``observe``, ``mask_dist``,
``intervene``; see ``inference.context``), and hold several contexts. Particles are
light: each context's KV state lives in a row of the batched backends.
"""

from __future__ import annotations

import asyncio
import dis
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from llamppl import Model

from ..potentials.conditions import Conditions
from ..potentials.constraints import Constraint
from ..potentials.twist import Twister
from .blocks import BlockRequest, CycleAnswer, CycleRequest, RowConstraint, ScoredBlock, check_constraint
from .context import LMContext


class CycleBarrier:
    """Gathers the block requests of all stepping particles into one batched call.

    A batch runs when every particle still stepping has asked (or returned from its step),
    so the synchronization is explicit, not a timer. Each cycle opens the barrier with the
    handler that serves its batches: a function from requests to their results.
    """

    def __init__(self) -> None:
        self.active = 0
        self.handler: Callable[[list[CycleRequest]], list[CycleAnswer]] | None = None
        self.pending: list[tuple[CycleRequest, asyncio.Future]] = []
        self.served = 0  # requests served since the cycle opened

    def open(self, n_active: int, handler: Callable[[list[CycleRequest]], list[CycleAnswer]]) -> None:
        """Start a cycle with ``n_active`` stepping particles, served by ``handler``."""
        self.active, self.handler, self.pending, self.served = n_active, handler, [], 0

    async def submit(self, item: CycleRequest) -> CycleAnswer:
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


@dataclass(frozen=True)
class Runtime:
    """What one step shares with the particles it steps (made by each step, bound to its copies).

    ``generator`` is the step's host generator: token-level draws use it; ``twists``: how a
    hard constraint is twisted by its future validity (None: it is not);
    ``conditions``: the vocabulary's per-token conditions (None: ``extend(condition=...)`` is refused).
    """

    barrier: CycleBarrier
    max_new_tokens: int
    decode: Callable[[Sequence[int]], str]
    eos: frozenset[int]
    generator: torch.Generator
    twists: Callable[[Constraint], Twister | None] = lambda _: None
    conditions: Conditions | None = None


class SMCSDModel(Model):
    """Base class of SMC-SD programs (a ``llamppl.Model``).

    Args:
        prompt: text (tokenized with the target's tokenizer, chat template applied
            for instruct models) or a list of token ids: the program's context
            ``self.context``. None for a program that builds its own ``LMContext``s.
        constraint: a hard constraint every output must satisfy (also applied to the
            first token), used by ``extend()`` by default.
        mode: how ``extend()`` applies it: ``"proposal"`` or ``"critic"``.

    Attributes:
        context: the program's main ``LMContext`` (its output is the particle's output).
        last_block: the ``ScoredBlock`` of the latest ``extend()``.
    """

    def __init__(
        self, prompt: str | Sequence[int] | None = None, constraint=None, mode: str = "proposal"
    ) -> None:
        super().__init__()
        check_constraint(constraint)
        self.prompt = prompt
        self.constraint, self.mode = constraint, mode
        if prompt is not None:
            self.context = LMContext(None, prompt)
        self.last_block: ScoredBlock | None = None
        self.runtime: Runtime | None = None
        self.unawaited: list[_Primitive] = []  # sample/observe/intervene calls not awaited yet

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

    def contexts(self) -> list[LMContext]:
        """The program's contexts, in attribute order (each has its own row)."""
        return [v for v in self.__dict__.values() if isinstance(v, LMContext)]

    @property
    def main_context(self) -> LMContext:
        """``self.context`` if it is a context, else the first one the program holds."""
        ctx = self.__dict__.get("context")
        if isinstance(ctx, LMContext):
            return ctx
        found = self.contexts()
        if not found:
            raise ValueError(
                f"{type(self).__name__} has no context: give it a prompt or an LMContext attribute"
            )
        return found[0]

    @property
    def token_ids(self) -> list[int]:
        """Tokens the main context has generated so far."""
        return self.main_context.generated

    @property
    def row(self) -> int:
        """The main context's row in the batched backends."""
        return self.main_context.row

    async def step(self) -> None:
        """The default program: plain SMC-SD generation."""
        await self.extend()

    async def extend(
        self,
        constraint=None,
        mode: str | None = None,
        context: LMContext | None = None,
        condition: Callable[[str], bool] | None = None,
    ) -> ScoredBlock:
        """Draft up to K tokens, score them with the target, weight, and commit them with the bonus.

        The block is one request to the cycle's batched call (every particle's blocks are
        drafted together and scored in one fused target forward); its SMC-SD log-weight
        enters through LLaMPPL's ``score``.

        Args:
            constraint: a hard constraint on the output (``smcsd_ppl.potentials``); the
                target becomes p^alpha x constraint. Defaults to ``self.constraint``.
            mode: ``"proposal"`` (the draft samples only allowed tokens) or ``"critic"``
                (the block is cut before its first impossible token). Defaults to ``self.mode``.
            context: the context to extend (default: the main context).
            condition: a test every emitted token's text must pass (``piece -> bool``), such
                as ``lambda piece: "e" not in piece``. It is applied once to each token of
                the vocabulary and enters as a hard constraint (with ``constraint``, both):
                the draft proposes, and the target draws, only passing tokens, and the
                weight carries the mass they kept, so no block is thrown away for one token.
                It must depend on the token's text alone (it is remembered by its code).

        Finishes the particle at an EOS token (drafted or bonus), when the context's
        ``max_new_tokens`` is reached, or when the constraint allows nothing more. Under the
        run's ``twist`` a hard constraint is twisted by its future validity: exactly (the
        constraint becomes a ``FutureValidity``), or by the cycle's one-step estimate, which
        enters as ``self.twist`` and is divided out before the next step and at the end.
        """
        if self.finished:
            raise ValueError("a finished particle cannot extend")
        ctx = self.main_context if context is None else context
        if self.runtime is None or ctx.runtime is None:
            raise ValueError(
                f"{type(self).__name__} is not bound to a run: run it with SMCSD.run or "
                "smcsd_ppl.llamppl.smc_standard (llamppl.smc_standard cannot batch its blocks)"
            )
        constraint = self._constraint_of(constraint, condition)
        row_constraint = None if constraint is None else self._row_constraint(constraint, mode, ctx)
        budget = self.runtime.max_new_tokens - len(ctx.generated)
        request = BlockRequest(ctx.row, budget, row_constraint, ctx.take_unsent(), ctx.mask)
        block: ScoredBlock = await self.runtime.barrier.submit(request)
        ctx.generated.extend(block.tokens)  # the row holds them already (the bonus queued)
        ctx.mask = None
        ctx.tilt = (len(ctx.generated), block.tilt)  # for the lead after these tokens, and no other
        self.last_block = block
        if block.log_weight == float("-inf") and row_constraint is not None:
            self.killed_by = row_constraint.mode  # a constraint, not a condition, ended it (for messages)
        self.score(block.log_weight)
        if block.stops:
            self.finish()
        elif block.log_future is not None:
            self.twist(block.log_future)
        return block

    def _constraint_of(self, constraint, condition) -> Constraint | None:
        """The block's hard constraint: the one given (else the program's), and the condition's mask."""
        constraint = self.constraint if constraint is None else constraint
        check_constraint(constraint)
        if condition is None:
            return constraint
        if self.runtime.conditions is None:
            raise ValueError("extend(condition=...) needs a run over a pair (SMCSD.run, or the engine)")
        return self.runtime.conditions.constraint(condition, constraint)

    def _row_constraint(self, constraint, mode: str | None, ctx) -> RowConstraint:
        """The block's constraint, under the run's twist: exact (a ``FutureValidity``), or estimated."""
        twist, lookahead = self.runtime.twists(constraint), False
        if twist is not None and not constraint.weighted:
            if twist.exact:
                constraint = twist.twisted(constraint, ctx.prompt_ids)
            else:
                lookahead = True
        # the tilt its last block read holds for the lead after exactly those tokens
        tilt = ctx.tilt[1] if lookahead and ctx.tilt[0] == len(ctx.generated) else None
        structure, finite = lookahead and twist.structure, lookahead and twist.finite
        context = tuple(ctx.generated)
        return RowConstraint(constraint, mode or self.mode, context, lookahead, structure, tilt, finite)

    # LLaMPPL's primitives, tracked so that a call a step forgot to await is reported.
    def sample(self, dist, proposal=None):
        """LLaMPPL's ``sample`` (await it)."""
        return _Primitive(self, "sample", super().sample(dist, proposal))

    def observe(self, dist, x):
        """LLaMPPL's ``observe`` (await it)."""
        return _Primitive(self, "observe", super().observe(dist, x))

    def intervene(self, dist, x):
        """LLaMPPL's ``intervene`` (await it)."""
        return _Primitive(self, "intervene", super().intervene(dist, x))

    @property
    def plain(self) -> bool:
        """Whether this is the plain program: unconstrained, and its ``step`` the default's.

        A subclass whose ``step`` only awaits ``self.extend()`` (and that starts as LLaMPPL's
        ``Model`` does) is the default program, and takes every decision the default takes:
        it decodes alone where the draft does not pay, retrieves, and cuts as ``generate`` does.
        A program that wants its N particles throughout sets ``plain = False`` on its class.
        """
        cls = type(self)
        return self.constraint is None and cls.start is Model.start and _same_code(cls.step, SMCSDModel.step)

    @property
    def budget(self) -> int:
        """How many more tokens the main context may emit."""
        return self.runtime.max_new_tokens - len(self.token_ids)

    @property
    def text(self) -> str:
        """The main context's generated text."""
        return self.runtime.decode(self.token_ids)

    def __str__(self) -> str:
        return self.text if self.runtime else f"{type(self).__name__}({self.prompt!r})"


def _same_code(f, g) -> bool:
    """Whether two functions run the same instructions on the same names and constants."""
    if f is g:
        return True

    def code(fn) -> list[tuple]:
        return [(i.opname, i.argval) for i in dis.get_instructions(fn) if i.opname not in ("RESUME", "NOP")]

    return code(f) == code(g)


class _Primitive:
    """An awaitable LLaMPPL primitive that remembers, until awaited, that it was called."""

    __slots__ = ("coro", "name", "owner")

    def __init__(self, owner: SMCSDModel, name: str, coro) -> None:
        self.owner, self.name, self.coro = owner, name, coro
        owner.__dict__.setdefault("unawaited", []).append(self)

    def __await__(self):
        self.owner.unawaited.remove(self)
        return self.coro.__await__()


def unawaited_calls(particle: SMCSDModel) -> str:
    """Which of ``sample``, ``observe``, ``intervene`` the particle's step called without await ('' if none).

    Those calls are closed, never run: they did nothing, and leave no "never awaited" warning.
    """
    pending = particle.__dict__.get("unawaited")
    if not pending:
        return ""
    name = sorted({p.name for p in pending})[0]
    for p in pending:
        p.coro.close()
    pending.clear()
    return name

"""The one SMC step: ``SMCSDKernel.step(state) -> (state, info)``.

A step runs every live particle's program once (their ``extend()`` calls batched into one
draft-and-verify call per barrier flush), then, per request: feeds the draft schedule what
the cycle's blocks saw, resamples when the ESS is low, and resizes the population to what
the schedule asks (one particle for a plain request decoding alone). Finally the row store
keeps the live particles' rows, in order. A step steps copies of the programs and builds a
new state: the state it was given is not written; the row store and the requests'
retrieval indices (which only grow, fed between cycles) are the things it changes. Every
draw of a request (tokens, resampling, token-level steps) comes from its own seed
(``streams``), so its output does not depend on which requests share its cycles.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch

from .. import smc
from ..config import DraftRecord, SMCConfig
from ..ends import row_ends
from ..keys import derive, generator
from ..potentials.conditions import Conditions
from ..potentials.constraints import Constraint
from ..potentials.twist import Twister
from ..proposals.blocks import RequestIndex
from . import proposing
from .blocks import CycleAnswer, CycleRequest, ScoredBlock
from .cycle import serve
from .program import CycleBarrier, Runtime, SMCSDModel, unawaited_calls
from .rows import RowStore
from .schedule import DraftSchedule, draft_step_cost, row_position_cost, schedule_from
from .state import Population, SMCState, StepInfo, resampled
from .streams import RowPlan, RowStreams, row_key

MAX_IDLE_CYCLES = 64  # cycles in a row in which no particle did anything: a step that never extends


def request_seed(seed: int, index: int) -> int:
    """The seed of request ``index`` of a call seeded with ``seed``: its own resampling stream."""
    return derive(seed, "request", index)


@dataclass(frozen=True)
class Admission:
    """A program joining a run, with its settings (None: the run's), seed, request id and draft record.

    ``seed`` None: the first request's seed of its settings (``request_seed(config.seed, 0)``);
    ``record`` None: the record ``admit`` is given.
    """

    program: SMCSDModel
    config: SMCConfig | None = None
    seed: int | None = None
    request_id: str = ""
    record: DraftRecord | None = None


class SMCSDKernel:
    """SMC-SD over a row store: ``init`` builds the state, ``step`` advances it.

    The kernel holds only what every step of a run shares (the row store, the settings);
    what one step needs (its barrier, its generators) it makes for itself.

    Args:
        store: the rows of the draft and the target.
        config: the run's settings (an admitted request may bring its own).
        eos: the model's EOS ids (a request of ``ignore_eos`` ends at none).
        decode: token ids -> text, for the particles' ``text``.
        conditions: the vocabulary's per-token conditions (``extend(condition=...)``; None: refused).
    """

    def __init__(
        self,
        store: RowStore,
        config: SMCConfig,
        eos: Sequence[int],
        decode: Callable,
        conditions: Conditions | None = None,
    ) -> None:
        self.store, self.config, self.eos, self.decode = store, config, frozenset(int(e) for e in eos), decode
        self.conditions = conditions
        self.draft_cost = draft_step_cost(
            getattr(store.draft, "n_params", None), getattr(store.target, "n_params", None)
        )
        self.row_cost = row_position_cost(store.device.type, getattr(store.target, "row_position_cost", None))
        self.twisters: dict[tuple, Twister] = {}

    def settings(self, pop: Population) -> SMCConfig:
        """A request's own settings (the run's unless it was admitted with others)."""
        return pop.config or self.config

    def eos_of(self, pop: Population) -> frozenset[int]:
        """The EOS ids a request ends at (none with ``ignore_eos``)."""
        return frozenset() if self.settings(pop).ignore_eos else self.eos

    def plain(self, program: SMCSDModel, config: SMCConfig) -> bool:
        """The request may decode alone with one particle: the plain program at alpha = 1."""
        return program.plain and config.alpha == 1.0

    def init(self, programs: Sequence[SMCSDModel], record: DraftRecord, encode: Callable | None) -> SMCState:
        """The state of a run of ``programs`` under the run's settings (program i seeded as request i)."""
        joining = [Admission(p, seed=request_seed(self.config.seed, i)) for i, p in enumerate(programs)]
        return self.admit(SMCState(()), joining, record, encode)

    @torch.inference_mode()
    def admit(
        self,
        state: SMCState,
        joining: Sequence[Admission],
        record: DraftRecord,
        encode: Callable | None,
        *,
        draft: bool = False,
    ) -> SMCState:
        """``state`` with the ``joining`` programs added: prompts prefilled, each forked into its particles.

        ``draft``: a new batch holds the draft's rows even if none of these requests drafts (an
        engine taking requests as they come: one that drafts may join later).

        Each new context gets rows of its own after the running ones; no token is drawn yet: a
        context's first token comes with its first step (a token-level draw, or a block's
        lead). The programs given are not written: a request's particles share one copy until they step.
        """
        joins = bool(state.populations) and self.store.n_rows > 0  # else the store starts afresh
        copies = [copy.deepcopy(a.program) for a in joining]
        prompts: list[list[int]] = []  # distinct prompts, each request's contexts in order
        for program in copies:
            for ctx in program.contexts():
                ctx.prompt_ids = _prompt_ids(ctx, encode)
                prompts.append(ctx.prompt_ids)
        base = self.store.n_rows if joins else 0
        pops, sources, first = [], [], 0  # sources: each row's prompt; first: a request's first prompt
        for a, program in zip(joining, copies):
            c = a.config or self.config
            index = proposing.new_index(program, self._candidates(c))
            schedule = self._schedule(program, c, a.record or record, index)
            count = c.n_particles if schedule is None else schedule.n_particles()
            width = len(program.contexts())
            at = base + len(sources)
            slots = tuple(tuple(range(at + k * width, at + (k + 1) * width)) for k in range(count))
            sources += [first + j for _ in range(count) for j in range(width)]
            first += width
            seed = request_seed(c.seed, 0) if a.seed is None else a.seed
            pops.append(
                Population(
                    (program,) * count,
                    (0.0,) * count,
                    slots,
                    seed,
                    schedule=schedule,
                    config=a.config,
                    retrieval=index,
                    request_id=a.request_id,
                )
            )
        drafting = draft or any(self._drafts(self.settings(p), p.schedule) for p in pops)
        if joins:
            self.store.append(prompts, sources)
        else:
            self.store.start(prompts, sources, draft=drafting)
        return replace(state, populations=(*state.populations, *pops))

    def needs_draft(self, program: SMCSDModel, config: SMCConfig, record: DraftRecord) -> bool:
        """Whether a request would draft from its first cycle (so its rows need the draft's)."""
        kinds = self._candidates(config)
        schedule = self._schedule(program, config, record, proposing.new_index(program, kinds))
        return self._drafts(config, schedule)

    def _drafts(self, c: SMCConfig, schedule: DraftSchedule | None) -> bool:
        """Whether a request may run the draft model (a schedule that turned the draft off stays so)."""
        return (
            not c.token_level
            and proposing.uses_draft(self._candidates(c))
            and not (schedule and schedule.draft_off)
        )

    def _candidates(self, c: SMCConfig) -> tuple[str, ...]:
        """The proposals a request with these settings may draft from."""
        return proposing.candidates(c, self.store.reads_hidden)

    def _schedule(
        self, program: SMCSDModel, c: SMCConfig, record: DraftRecord, index: RequestIndex | None
    ) -> DraftSchedule | None:
        """A request's first draft schedule (None without the quality cut, or drafting nothing)."""
        if c.cut is None or c.token_level:
            return None
        kinds, plain = self._candidates(c), self.plain(program, c)
        schedule = schedule_from(
            record, c.block_size, c.n_particles, plain, self.draft_cost, kinds, self.row_cost
        )
        return schedule.advanced(proposing.continues(index, program, plain))

    async def step(self, state: SMCState) -> tuple[SMCState, StepInfo]:
        """One cycle of every request: step copies of the programs, then reweigh, resample, resize, pack.

        ``state`` is not written; the row store and the retrieval indices are what a step changes. Every draw
        of a request comes from its own seed and the cycle.
        """
        barrier = CycleBarrier()
        bound = [pop.bound(self._runtime(pop, barrier)) for pop in state.populations]
        stepping = [(p, self.settings(pop).max_new_tokens) for pop in bound for p in pop.particles]
        stepping = [(p, budget) for p, budget in stepping if not p.done_stepping()]
        live = [p for p, _ in stepping]
        starting = {id(p) for pop in bound if pop.cycles == 0 for p in pop.particles}
        streams = RowStreams(
            {
                ctx.row: self._plan(pop, slot, c, ctx)
                for pop in bound
                for slot, p in enumerate(pop.particles)
                if not p.done_stepping()
                for c, ctx in enumerate(p.contexts())
            }
        )
        blocks: dict[int, list[ScoredBlock]] = {}

        def handler(requests: list[CycleRequest]) -> list[CycleAnswer]:
            out = serve(self.store, requests, config=self.config, eos=self.eos, streams=streams)
            for b in out:
                if isinstance(b, ScoredBlock):
                    blocks.setdefault(b.row, []).append(b)
            return out

        before = [_progress(p) for p in live]
        await _step_programs(live, barrier, handler, starting)
        self._settle(stepping)
        idle = self._idle(state, live, before, barrier)
        cycle, new, ess, did, before = state.cycle + 1, [], [], [], []
        for pop, old in zip(bound, state.populations):
            pop = pop.stepped(old)
            proposing.fed(pop, old)
            plans = [(streams.plans[r], b) for rs in pop.rows for r in rs for b in blocks.get(r, [])]
            pop = proposing.observed(pop, [((plan.kind, plan.limit), b) for plan, b in plans])
            faults = [b.fault for _, b in plans if b.fault]
            # Its rows share each forward: a row's sum over the cycle's flushes, the most of any row.
            drafted = max(
                (sum(b.draft_forwards for b in blocks.get(r, [])) for rs in pop.rows for r in rs), default=0
            )
            pop = replace(
                pop, fault=pop.fault or (faults[0] if faults else ""), draft_calls=pop.draft_calls + drafted
            )
            before.append(pop)
            g = generator(derive(pop.seed, "resample", pop.cycles + 1))
            pop, e, r = self._maybe_resample(pop, g)
            new.append(self._resized(pop, g))
            ess.append(e)
            did.append(r)
        out = SMCState(tuple(self.pack(new)), cycle, idle)
        every = [p for pop in out.populations for p in pop.particles]
        live_after = sum(not p.done_stepping() for p in every)
        longest = max((len(p.token_ids) for p in every), default=0)
        info = StepInfo(cycle, live_after, longest, tuple(ess), tuple(did), out.populations, tuple(before))
        return out, info

    def _runtime(self, pop: Population, barrier: CycleBarrier) -> Runtime:
        """What a request's particles share in a step: the barrier, its budget, its token-level draws."""
        g = generator(derive(pop.seed, "tokens", pop.cycles + 1))
        c = self.settings(pop)
        twists = partial(self._twister, c)
        return Runtime(barrier, c.max_new_tokens, self.decode, self.eos_of(pop), g, twists, self.conditions)

    def _twister(self, c: SMCConfig, constraint: Constraint) -> Twister | None:
        """The twist settings ``c`` give ``constraint`` (one per setting: its dynamic programmes are kept)."""
        name = c.twist_on(constraint)
        if name is None:
            return None
        # A greedy target's output is its argmax path whatever the twist: it reads the model at T = 1.
        key = (name, c.target_temperature or 1.0, c.alpha, c.max_new_tokens)
        if key not in self.twisters:
            self.twisters[key] = Twister(self.store.target, *key[1:], name=name)
        return self.twisters[key]

    def _plan(self, pop: Population, slot: int, context: int, ctx) -> RowPlan:
        """A live row's plan for the step: its draft length and proposal, its draws' key, temperatures."""
        c = self.settings(pop)
        key = row_key(pop.seed, pop.cycles + 1, slot, context)
        kind, length = proposing.particle_plan(pop, slot, c)
        proposal = proposing.row_proposal(pop, kind, ctx)
        temps = c.target_temperature, c.draft_temperature
        sampling = c.sampling if c.sampling.active else None
        return RowPlan(length, key, *temps, kind, proposal, c.block_size, not c.ignore_eos, sampling)

    def _settle(self, live: list[tuple[SMCSDModel, int]]) -> None:
        """After the programs stepped (with their budgets): nothing left un-awaited; out of budget ends."""
        forgotten = {type(p).__name__: name for p, _ in live if (name := unawaited_calls(p))}
        if forgotten:
            program, name = next(iter(forgotten.items()))
            raise ValueError(
                f"{program}.step() called self.{name}(...) without await, which does nothing: "
                f"write `await self.{name}(...)`"
            )
        for p, budget in live:
            # Token-level steps reach the budget here (a block stops there itself); an EOS
            # drawn at token level is the program's to act on, as in LLaMPPL.
            if not p.finished and any(row_ends(-1, len(x.generated), budget, ()) for x in p.contexts()):
                p.finish()

    def _idle(self, state: SMCState, live: list[SMCSDModel], before: list, barrier: CycleBarrier) -> int:
        """Consecutive cycles in which no particle asked, ended or changed; too many is a program bug."""
        if barrier.served or [_progress(p) for p in live] != before:
            return 0
        if state.idle + 1 >= MAX_IDLE_CYCLES:
            name = type(live[0]).__name__
            raise ValueError(
                f"{name}.step() made no progress in {MAX_IDLE_CYCLES} cycles (no particle extended, took a "
                "token-level step, changed weight or finished): every step must call extend(), a "
                "token-level step, or self.finish()"
            )
        return state.idle + 1

    def _maybe_resample(self, pop: Population, g: torch.Generator) -> tuple[Population, float, bool]:
        """Resample a request whose ESS fell under ``ess_threshold * N``; returns its ESS and whether."""
        c, log_w, n = self.settings(pop), pop.log_weights(), len(pop.particles)
        pop = replace(pop, particle_trace=(*pop.particle_trace, n))
        if not torch.isfinite(log_w).any():  # every particle is dead; nothing to resample from
            return replace(pop, ess_trace=(*pop.ess_trace, 0.0)), 0.0, False
        e = smc.ess(log_w)
        pop = replace(
            pop,
            ess_trace=(*pop.ess_trace, e),
            ess_fractions=(*pop.ess_fractions, *([e / n] if n >= 2 else [])),
        )
        if not smc.below_threshold(e, n, c.ess_threshold):
            return pop, e, False
        pop = resampled(pop, c.resampling, g)
        return replace(pop, n_resamples=pop.n_resamples + 1), e, True

    def _resized(self, pop: Population, g: torch.Generator) -> Population:
        """Decide the next plan; draw the particle count the schedule asks for (one, alone)."""
        if pop.schedule is None or not pop.stepping:
            return pop
        schedule: DraftSchedule = pop.schedule.advanced(proposing.retrievable(pop))
        pop = replace(pop, schedule=schedule)
        want = schedule.n_particles()
        return pop if want == len(pop.particles) else resampled(pop, self.settings(pop).resampling, g, want)

    def pack(self, pops: list[Population]) -> list[Population]:
        """One fork: live particles' contexts get consecutive rows; finished ones release theirs."""
        kept: list[int] = []
        out = []
        for pop in pops:
            rows = []
            for p, old in zip(pop.particles, pop.rows):
                if p.done_stepping():
                    rows.append((-1,) * len(old))
                else:
                    rows.append(tuple(range(len(kept), len(kept) + len(old))))
                    kept += old
            out.append(replace(pop, rows=tuple(rows)))
        self.store.fork(kept)
        return out


async def _step_programs(
    live: list[SMCSDModel], barrier: CycleBarrier, serve: Callable, starting: set
) -> None:
    """Run every live particle's step (a request's first runs LLaMPPL's ``start()`` before it)."""
    barrier.open(len(live), serve)

    async def step(p: SMCSDModel) -> None:
        try:
            if id(p) in starting:
                await p.start()
            if not p.done_stepping():
                await p.step()
        finally:
            barrier.leave()

    outcomes = await asyncio.gather(*(step(p) for p in live), return_exceptions=True)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    if errors:
        raise errors[0]


def _progress(p: SMCSDModel) -> tuple:
    """What shows a particle did something in a step: its weight, whether it ended, its tokens."""
    return p.weight, p.finished, sum(len(x.generated) for x in p.contexts())


def _prompt_ids(ctx, encode) -> list[int]:
    """A context's prompt as token ids (its model's ``encode``, else the run's, for a text)."""
    prompt = ctx.prompt
    if isinstance(prompt, str):
        encode = getattr(ctx.lm, "encode", None) or encode
        if encode is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or an encode function")
        return encode(prompt)
    return [int(t) for t in prompt]

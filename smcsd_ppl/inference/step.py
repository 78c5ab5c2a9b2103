"""The one SMC step: ``SMCSDKernel.step(state, key) -> (state, info)``.

A step runs every live particle's program once (their ``extend()`` calls batched into one
draft-and-verify call per barrier flush), then, per request: feeds the draft schedule what
the cycle's blocks saw, resamples when the ESS is low, and resizes the population to what
the schedule asks (one particle for a plain request decoding alone). Finally the row store
keeps the live particles' rows, in order. A step steps copies of the programs and builds a
new state: the state it was given is not written, and the row store is the one thing it
changes. Token draws come from the step's key; each request's resampling from its own seed.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from .. import smc
from ..config import DraftRecord, SMCConfig
from ..ends import row_ends
from . import proposing
from .blocks import CycleAnswer, CycleRequest, ScoredBlock
from .cycle import serve
from .program import CycleBarrier, Runtime, SMCSDModel, unawaited_calls
from .rows import RowStore
from .schedule import DraftSchedule, draft_step_cost, retrieval_step_cost, schedule_from
from .state import Population, SMCState, StepInfo, resampled

MAX_IDLE_CYCLES = 64  # cycles in a row in which no particle did anything: a step that never extends


def step_key(seed: int, step: int) -> int:
    """The key of step ``step`` of a run seeded with ``seed`` (0 starts it; -1 selects the outputs)."""
    digest = hashlib.blake2b(f"{seed}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def request_seed(seed: int, index: int) -> int:
    """The seed of request ``index`` of a call seeded with ``seed``: its own resampling stream."""
    return step_key(seed, -2 - index)


def host_generator(key: int) -> torch.Generator:
    """The host generator of a key (resampling, output choice, token-level draws)."""
    return torch.Generator().manual_seed(key ^ 0x5DEECE66D)


def generators(key: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """Two independent generators from one key: on the device (tokens), on the host."""
    return torch.Generator(device=device).manual_seed(key), host_generator(key)


class SMCSDKernel:
    """SMC-SD over a row store: ``init`` builds the state, ``step`` advances it.

    The kernel holds only what every step of a run shares (the row store, the settings);
    what one step needs (its barrier, its generators) it makes for itself.

    Args:
        store: the rows of the draft and the target.
        config: the run's settings.
        eos: EOS ids in force.
        decode: token ids -> text, for the particles' ``text``.
    """

    def __init__(self, store: RowStore, config: SMCConfig, eos: Sequence[int], decode: Callable) -> None:
        self.store, self.config, self.eos, self.decode = store, config, frozenset(int(e) for e in eos), decode
        self.draft_cost = draft_step_cost(
            getattr(store.draft, "n_params", None), getattr(store.target, "n_params", None), store.device.type
        )
        self.proposals = proposing.candidates(config, store.reads_hidden)

    def plain(self, program: SMCSDModel) -> bool:
        """The request may decode alone with one particle: the plain program at alpha = 1."""
        return program.plain and self.config.alpha == 1.0

    @torch.inference_mode()
    def init(self, programs: Sequence[SMCSDModel], record: DraftRecord, encode: Callable | None) -> SMCState:
        """Prefill every context's prompt and fork each request into its particles.

        Each particle's contexts get rows of their own; no token is drawn yet: a context's
        first token comes with its first step (a token-level draw, or a block's lead). The
        programs given are not written: each request's particles share one copy of its program
        until they step.
        """
        c = self.config
        kinds, cost = self.proposals, retrieval_step_cost(self.store.device.type)
        copies = [copy.deepcopy(p) for p in programs]
        prompts: list[list[int]] = []  # distinct prompts, each request's contexts in order
        for program in copies:
            for ctx in program.contexts():
                ctx.prompt_ids = _prompt_ids(ctx, encode)
                prompts.append(ctx.prompt_ids)
        indices = [proposing.new_index(p, kinds) for p in copies]
        schedules = [
            schedule_from(
                record, c.block_size, c.n_particles, self.plain(p), self.draft_cost, kinds, cost
            ).advanced(proposing.continues(index, p))
            if c.cut is not None and not c.token_level
            else None
            for p, index in zip(copies, indices)
        ]
        counts = [c.n_particles if s is None else s.n_particles() for s in schedules]
        pops, sources, first = [], [], 0  # sources: each row's prompt; first: a request's first prompt
        for i, (program, count, schedule) in enumerate(zip(copies, counts, schedules)):
            width = len(program.contexts())
            slots = tuple(
                tuple(range(len(sources) + k * width, len(sources) + (k + 1) * width)) for k in range(count)
            )
            sources += [first + j for _ in range(count) for j in range(width)]
            first += width
            seed = request_seed(c.seed, i)
            pops.append(
                Population(
                    (program,) * count, (0.0,) * count, slots, seed, schedule=schedule, retrieval=indices[i]
                )
            )
        drafting = (
            not c.token_level
            and proposing.uses_draft(kinds)
            and any(s is None or not s.draft_off for s in schedules)
        )
        self.store.start(prompts, sources, draft=drafting)
        return SMCState(tuple(pops))

    async def step(self, state: SMCState, key: int) -> tuple[SMCState, StepInfo]:
        """One cycle of every request: step copies of the programs, then reweigh, resample, resize, pack.

        ``state`` is not written; the row store is the one thing a step changes. Token draws
        come from ``key``, each request's resampling from its own seed and the cycle.
        """
        g_tokens, g_draws = generators(key, self.store.device)
        runtime = Runtime(CycleBarrier(), self.config.max_new_tokens, self.decode, self.eos, g_draws)
        bound = [pop.bound(runtime) for pop in state.populations]
        live = [p for pop in bound for p in pop.particles if not p.done_stepping()]
        plans, limits, proposals = {}, {}, {}
        for pop in bound:
            for slot, p in enumerate(pop.particles):
                if p.done_stepping():
                    continue
                kind, length = proposing.particle_plan(pop, slot, self.config)
                for ctx in p.contexts():
                    plans[ctx.row], limits[ctx.row] = (kind, length), length
                    if (rp := proposing.row_proposal(pop, kind, ctx)) is not None:
                        proposals[ctx.row] = rp
        blocks: dict[int, list[ScoredBlock]] = {}

        def handler(requests: list[CycleRequest]) -> list[CycleAnswer]:
            out = serve(
                self.store,
                requests,
                config=self.config,
                eos=self.eos,
                limits=limits,
                g=g_tokens,
                proposals=proposals,
            )
            for b in out:
                if isinstance(b, ScoredBlock):
                    blocks.setdefault(b.row, []).append(b)
            return out

        before = [_progress(p) for p in live]
        await _step_programs(live, runtime.barrier, handler, first=state.cycle == 0)
        self._settle(live)
        idle = self._idle(state, live, before, runtime.barrier)
        cycle, new, ess, did = state.cycle + 1, [], [], []
        for pop, old in zip(bound, state.populations):
            pop = pop.stepped(old)
            proposing.fed(pop, old)
            pop = proposing.observed(
                pop, [(plans[r], b) for rs in pop.rows for r in rs for b in blocks.get(r, [])]
            )
            g = host_generator(step_key(pop.seed, cycle))
            pop, e, r = self._maybe_resample(pop, g)
            new.append(self._resized(pop, g))
            ess.append(e)
            did.append(r)
        out = SMCState(tuple(self.pack(new)), cycle, idle)
        every = [p for pop in out.populations for p in pop.particles]
        live_after = sum(not p.done_stepping() for p in every)
        longest = max(len(p.token_ids) for p in every)
        info = StepInfo(cycle, live_after, longest, tuple(ess), tuple(did), out.populations)
        return out, info

    def _settle(self, live: list[SMCSDModel]) -> None:
        """After the programs stepped: no primitive left un-awaited; a context out of budget ends."""
        forgotten = {type(p).__name__: name for p in live if (name := unawaited_calls(p))}
        if forgotten:
            program, name = next(iter(forgotten.items()))
            raise ValueError(
                f"{program}.step() called self.{name}(...) without await, which does nothing: "
                f"write `await self.{name}(...)`"
            )
        budget = self.config.max_new_tokens
        for p in live:
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
        c, log_w, n = self.config, pop.log_weights(), len(pop.particles)
        pop = replace(pop, particle_trace=(*pop.particle_trace, n))
        if not torch.isfinite(log_w).any():  # every particle is dead; nothing to resample from
            return replace(pop, ess_trace=(*pop.ess_trace, 0.0)), 0.0, False
        e = smc.ess(log_w)
        pop = replace(
            pop,
            ess_trace=(*pop.ess_trace, e),
            ess_fractions=(*pop.ess_fractions, *([e / n] if n >= 2 else [])),
        )
        if n < 2 or c.ess_threshold == 0 or e >= c.ess_threshold * n:
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
        return pop if want == len(pop.particles) else resampled(pop, self.config.resampling, g, want)

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


async def _step_programs(live: list[SMCSDModel], barrier: CycleBarrier, serve: Callable, first: bool) -> None:
    """Run every live particle's step (the first cycle runs LLaMPPL's ``start()`` before it)."""
    barrier.open(len(live), serve)

    async def step(p: SMCSDModel) -> None:
        try:
            if first:
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

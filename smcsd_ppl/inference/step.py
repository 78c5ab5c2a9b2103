"""The one SMC step: ``SMCSDKernel.step(state, key) -> (state, info)``.

A step runs every live particle's program once (their ``extend()`` calls batched into one
draft-and-verify call per barrier flush), then, per request: feeds the draft schedule what
the cycle's blocks saw, resamples when the ESS is low, and resizes the population to what
the schedule asks (one particle for a plain request decoding alone). Finally the row store
keeps the live particles' rows, in order. All randomness comes from ``key``.
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
from .blocks import ScoredBlock
from .cycle import serve
from .program import CycleBarrier, Runtime, SMCSDModel, unawaited_calls
from .rows import RowStore
from .schedule import DraftSchedule, draft_step_cost, schedule_from
from .state import Population, SMCState, StepInfo, resampled, settled_tokens

MAX_IDLE_CYCLES = 64  # cycles in a row in which no particle did anything: a step that never extends


def step_key(seed: int, step: int) -> int:
    """The key of step ``step`` of a run seeded with ``seed`` (0 starts it; -1 selects the outputs)."""
    digest = hashlib.blake2b(f"{seed}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generators(key: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """Two independent generators from one key: on the device (tokens), on the host (resampling)."""
    return (
        torch.Generator(device=device).manual_seed(key),
        torch.Generator().manual_seed(key ^ 0x5DEECE66D),
    )


class SMCSDKernel:
    """SMC-SD over a row store: ``init`` builds the state, ``step`` advances it.

    Args:
        store: the rows of the draft and the target.
        config: the run's settings.
        eos: EOS ids in force.
        decode: token ids -> text, for the particles' ``text``.
    """

    def __init__(self, store: RowStore, config: SMCConfig, eos: Sequence[int], decode: Callable) -> None:
        self.store, self.config, self.eos = store, config, frozenset(int(e) for e in eos)
        self.runtime = Runtime(CycleBarrier(), config.max_new_tokens, decode, self.eos)
        self.draft_cost = draft_step_cost(
            getattr(store.draft, "n_params", None), getattr(store.target, "n_params", None), store.device.type
        )

    def plain(self, program: SMCSDModel) -> bool:
        """The request may decode alone with one particle: the plain program at alpha = 1."""
        return program.plain and self.config.alpha == 1.0

    @torch.inference_mode()
    def init(self, programs: Sequence[SMCSDModel], record: DraftRecord, encode: Callable | None) -> SMCState:
        """Prefill every context's prompt and fork each request into its particles.

        Each particle's contexts get rows of their own; no token is drawn yet: a context's
        first token comes with its first step (a token-level draw, or a block's lead).
        """
        c = self.config
        schedules = [
            schedule_from(record, c.block_size, c.n_particles, self.plain(p), self.draft_cost).advanced()
            if c.cut is not None and not c.token_level
            else None
            for p in programs
        ]
        counts = [c.n_particles if s is None else s.n_particles() for s in schedules]
        prompts, first = [], []  # distinct prompts; index of each program's first
        for program in programs:
            program.runtime = self.runtime
            first.append(len(prompts))
            prompts += [_prompt_ids(ctx, encode) for ctx in program.contexts()]
        rows = [
            first[i] + j
            for i, p in enumerate(programs)
            for _ in range(counts[i])
            for j in range(len(p.contexts()))
        ]
        drafting = not c.token_level and any(s is None or s.length != 0 for s in schedules)
        self.store.start(prompts, rows, draft=drafting)
        pops, row = [], 0
        for i, program in enumerate(programs):
            particles = tuple(copy.deepcopy(program) for _ in range(counts[i]))
            for p in particles:
                for j, ctx in enumerate(p.contexts()):
                    ctx.row, ctx.prompt_ids, ctx.runtime = row, prompts[first[i] + j], self.runtime
                    row += 1
            pops.append(Population(particles, schedule=schedules[i]))
        return SMCState(tuple(pops), record)

    async def step(self, state: SMCState, key: int) -> tuple[SMCState, StepInfo]:
        """One cycle of every request: step the programs, then reweigh, resample, resize, pack."""
        g_tokens, g_host = generators(key, self.store.device)
        self.runtime.generator = torch.Generator().manual_seed(key ^ 0x2545F491)  # token-level draws
        pops = state.populations
        for pop in pops:
            for p in pop.particles:
                p.untwist()
        live = [p for pop in pops for p in pop.particles if not p.done_stepping()]
        limits = {
            ctx.row: self._draft_length(pop)
            for pop in pops
            for p in pop.particles
            if not p.done_stepping()
            for ctx in p.contexts()
        }
        blocks: dict[int, list[ScoredBlock]] = {}

        def handler(requests: list) -> list:
            out = serve(self.store, requests, config=self.config, eos=self.eos, limits=limits.get, g=g_tokens)
            for b in out:
                if isinstance(b, ScoredBlock):
                    blocks.setdefault(b.row, []).append(b)
            return out

        before = [(p.weight, p.finished, sum(len(x.generated) for x in p.contexts())) for p in live]
        await self._step_programs(live, handler, first=state.cycle == 0)
        self._settle(live)
        idle = self._idle(state, live, before)
        new, ess, did = [], [], []
        for pop in pops:
            rows = [ctx.row for p in pop.particles for ctx in p.contexts()]
            pop = self._observed(pop, [b for r in rows for b in blocks.get(r, [])])
            pop, e, r = self._maybe_resample(pop, g_host)
            new.append(self._resized(pop, g_host))
            ess.append(e)
            did.append(r)
        self._pack(new)
        out = SMCState(tuple(new), state.record, state.cycle + 1, idle)
        every = [p for pop in new for p in pop.particles]
        live_after = sum(not p.done_stepping() for p in every)
        info = StepInfo(
            out.cycle,
            live_after,
            max(len(p.token_ids) for p in every),
            tuple(ess),
            tuple(did),
            tuple(settled_tokens(pop) for pop in new),
        )
        return out, info

    def _draft_length(self, pop: Population) -> int:
        """How many tokens a request's rows draft this cycle (0: the target alone)."""
        if self.config.token_level:
            return 0
        return pop.schedule.length if pop.schedule is not None else self.config.block_size

    def _settle(self, live: list[SMCSDModel]) -> None:
        """After the programs stepped: no primitive left un-awaited; a context out of budget ends."""
        forgotten = {type(p).__name__: name for p in live if (name := unawaited_calls(p))}
        if forgotten:
            program, name = next(iter(forgotten.items()))
            raise ValueError(
                f"{program}.step() called self.{name}(...) without await, which does nothing: "
                f"write `await self.{name}(...)`"
            )
        budget = self.runtime.max_new_tokens
        for p in live:
            if not p.finished and any(len(x.generated) >= budget for x in p.contexts()):
                p.finish()  # token-level steps reach the budget here (a block stops there itself)

    def _idle(self, state: SMCState, live: list[SMCSDModel], before: list) -> int:
        """Consecutive cycles in which no particle asked, ended or changed; too many is a program bug."""
        after = [(p.weight, p.finished, sum(len(x.generated) for x in p.contexts())) for p in live]
        if self.runtime.barrier.served or after != before:
            return 0
        if state.idle + 1 >= MAX_IDLE_CYCLES:
            name = type(live[0]).__name__
            raise ValueError(
                f"{name}.step() made no progress in {MAX_IDLE_CYCLES} cycles (no particle extended, took a "
                "token-level step, changed weight or finished): every step must call extend(), a "
                "token-level step, or self.finish()"
            )
        return state.idle + 1

    async def _step_programs(self, live: list[SMCSDModel], serve: Callable, first: bool) -> None:
        """Run every live particle's step (the first cycle runs LLaMPPL's ``start()`` before it)."""
        barrier = self.runtime.barrier
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

    def _observed(self, pop: Population, blocks: list[ScoredBlock]) -> Population:
        """The schedule after the blocks this cycle drafted (undrafted ones teach nothing)."""
        if pop.schedule is None:
            return pop
        drafted = [b for b in blocks if b.drafted]
        return replace(
            pop, schedule=pop.schedule.observed([b.kept for b in drafted], [b.diverged for b in drafted])
        )

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
        """Decide the next draft length; draw the particle count the schedule asks for (one, alone)."""
        if pop.schedule is None or not pop.stepping:
            return pop
        schedule: DraftSchedule = pop.schedule.advanced()
        pop = replace(pop, schedule=schedule)
        want = schedule.n_particles()
        return pop if want == len(pop.particles) else resampled(pop, self.config.resampling, g, want)

    def _pack(self, pops: list[Population]) -> None:
        """One fork: live particles' contexts get consecutive rows; finished ones release theirs."""
        rows = []
        for pop in pops:
            for p in pop.particles:
                for ctx in p.contexts():
                    if p.done_stepping():
                        ctx.row = -1
                    else:
                        rows.append(ctx.row)
                        ctx.row = len(rows) - 1
        self.store.fork(rows)


def _prompt_ids(ctx, encode) -> list[int]:
    """A context's prompt as token ids (its model's ``encode``, else the run's, for a text)."""
    prompt = ctx.prompt
    if isinstance(prompt, str):
        encode = getattr(ctx.lm, "encode", None) or encode
        if encode is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or an encode function")
        return encode(prompt)
    return [int(t) for t in prompt]

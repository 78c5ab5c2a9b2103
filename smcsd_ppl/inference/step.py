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
from ..verification import power_log_normalizer, restrict_power, sample_tokens
from . import constrained
from .blocks import BlockRequest, ScoredBlock
from .cycle import run_blocks
from .program import CycleBarrier, Runtime, SMCSDModel
from .rows import RowStore
from .schedule import DraftSchedule, draft_step_cost, schedule_from
from .state import Population, SMCState, StepInfo, resampled


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
    def init(
        self, programs: Sequence[SMCSDModel], prompts: Sequence[Sequence[int]], record: DraftRecord, key: int
    ) -> SMCState:
        """Prefill, fork each request into its particles, and draw every particle's first token.

        Each row draws its own first token x0 from p_T^alpha (restricted to what a
        constraint allows), so no later weight has a shared draw to correct; x0's weight,
        the same for every row of a request, goes into log Z.
        """
        c = self.config
        schedules = [
            schedule_from(record, c.block_size, c.n_particles, self.plain(p), self.draft_cost).advanced()
            if c.cut is not None
            else None
            for p in programs
        ]
        counts = [c.n_particles if s is None else s.n_particles() for s in schedules]
        drafting = any(s is None or s.length != 0 for s in schedules)
        logits, hidden = self.store.start(prompts, counts, draft=drafting)  # [R, V]
        request = [i for i, n in enumerate(counts) for _ in range(n)]
        x0, log_z0 = self._first_tokens(logits, [programs[i].constraint for i in request], key)
        self.store.queue_first(x0, hidden)
        pops, row = [], 0
        for i, program in enumerate(programs):
            program.runtime = self.runtime
            particles = tuple(copy.deepcopy(program) for _ in range(counts[i]))
            for p in particles:
                p.row, p.token_ids = row, [x0[row]]
                if x0[row] in self.eos or c.max_new_tokens == 1:
                    p.finish()
                row += 1
            schedule = schedules[i]
            if schedule is not None and all(p.finished for p in particles):
                schedule = replace(schedule, lengths=())  # no cycle will run
            pops.append(Population(particles, log_z=log_z0[row - 1], schedule=schedule))
        return SMCState(tuple(pops), record)

    def _first_tokens(
        self, logits: torch.Tensor, constraints: list, key: int
    ) -> tuple[list[int], list[float]]:
        """x0 per row ``logits [R, V]`` from the (restricted) target power, and its log normalizer."""
        c = self.config
        log_z = power_log_normalizer(logits, c.target_temperature, c.alpha)
        allowed = None
        if any(x is not None for x in constraints):
            masks = constrained.masks_for([(x, ()) for x in constraints if x is not None])
            full = torch.ones(logits.shape[-1], dtype=torch.bool)
            it = iter(masks)
            allowed = torch.stack([full if x is None else next(it) for x in constraints]).to(logits.device)
        power, log_z = restrict_power(c.alpha * logits.float() / c.target_temperature, log_z, allowed)
        if not torch.isfinite(log_z).all():
            raise ValueError("the constraint allows no first token: no output can satisfy it")
        g, _ = generators(key, self.store.device)
        return sample_tokens(power, 1.0, g).tolist(), log_z.tolist()

    async def step(self, state: SMCState, key: int) -> tuple[SMCState, StepInfo]:
        """One cycle of every request: step the programs, then reweigh, resample, resize, pack."""
        g_tokens, g_host = generators(key, self.store.device)
        pops = state.populations
        for pop in pops:
            for p in pop.particles:
                p.untwist()
        limits = {
            p.row: pop.schedule.length if pop.schedule is not None else self.config.block_size
            for pop in pops
            for p in pop.particles
            if not p.done_stepping()
        }
        blocks: dict[int, list[ScoredBlock]] = {}

        def serve(requests: list[BlockRequest]) -> list[ScoredBlock]:
            out = run_blocks(
                self.store,
                requests,
                config=self.config,
                eos=self.eos,
                limits=[limits[r.row] for r in requests],
                g=g_tokens,
            )
            for b in out:
                blocks.setdefault(b.row, []).append(b)
            return out

        await self._step_programs([p for pop in pops for p in pop.particles if not p.done_stepping()], serve)
        new, ess, did = [], [], []
        for pop in pops:
            pop = self._observed(pop, [b for p in pop.particles for b in blocks.get(p.row, [])])
            pop, e, r = self._maybe_resample(pop, g_host)
            new.append(self._resized(pop, g_host))
            ess.append(e)
            did.append(r)
        self._pack(new)
        out = SMCState(tuple(new), state.record, state.cycle + 1)
        every = [p for pop in new for p in pop.particles]
        info = StepInfo(
            out.cycle,
            sum(not p.done_stepping() for p in every),
            max(len(p.token_ids) for p in every),
            tuple(ess),
            tuple(did),
        )
        return out, info

    async def _step_programs(self, live: list[SMCSDModel], serve: Callable) -> None:
        barrier = self.runtime.barrier
        barrier.open(len(live), serve)

        async def step(p: SMCSDModel) -> None:
            try:
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
        """One fork: live particles get consecutive rows; finished ones release theirs."""
        rows = []
        for pop in pops:
            for p in pop.particles:
                if p.done_stepping():
                    p.row = -1
                else:
                    rows.append(p.row)
                    p.row = len(rows) - 1
        self.store.fork(rows)

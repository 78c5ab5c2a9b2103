"""The one SMC loop: every program, plain generation included, runs here."""

from __future__ import annotations

import asyncio
import copy
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .. import smc
from ..config import SMCConfig
from ..potentials.constraints import allows
from ..results import ParticleOut
from .engine import BlockEngine
from .program import CycleBarrier, Runtime, SMCSDModel
from .schedule import DraftSchedule

# A request whose ESS averages under this share of its particles is flagged as collapsed:
# its output is then close to the best of a few draft samples, not a target sample.
COLLAPSE_ESS_FRACTION = 0.3


@dataclass
class CycleInfo:
    """What one cycle did, for progress reporting (BlackJAX-style step info)."""

    cycle: int
    live: int  # particles still stepping, all requests
    tokens: int  # tokens of the longest particle so far
    ess: list[float]  # ESS per request before any resampling
    resampled: list[bool]


@dataclass
class SMCResult:
    """The outcome of one request.

    Attributes:
        token_ids: the selected particle's output tokens (empty if every particle died).
        text: the selected particle's output text.
        log_z: estimate of log Z (unbiased in Z), the target's normalizer relative to q.
        particles: all final particles with their log-weights.
        chosen: index of the selected particle, or -1 when none had positive weight.
        ess_trace: ESS before each cycle's resampling decision.
        n_resamples: resampling rounds.
        message: why the result is empty or incomplete, if it is.
        collapsed: the ESS averaged under ``COLLAPSE_ESS_FRACTION`` of the particles: the
            draft is too far from the target at these settings.
        draft_lengths: with ``SMCConfig.cut``, the draft length of each cycle (0: the
            target alone).
    """

    token_ids: list[int]
    text: str
    log_z: float
    particles: list[ParticleOut]
    chosen: int
    ess_trace: list[float] = field(default_factory=list)
    n_resamples: int = 0
    message: str = ""
    collapsed: bool = False
    draft_lengths: list[int] = field(default_factory=list)


@dataclass
class _Population:
    particles: list[SMCSDModel]
    log_z: float = 0.0
    ess_trace: list[float] = field(default_factory=list)
    ess_fractions: list[float] = field(default_factory=list)  # ESS / N where N >= 2
    n_resamples: int = 0
    schedule: DraftSchedule | None = None

    def log_weights(self) -> torch.Tensor:
        """The particles' log-weights ``[N]`` (float64; NaN cleaned to -inf)."""
        return smc.clean_log_weights(torch.tensor([p.weight for p in self.particles], dtype=torch.float64))


async def smc_sd(
    programs: Sequence[SMCSDModel],
    engine: BlockEngine,
    *,
    encode: Callable[[str], list[int]] = None,
    decode: Callable[[Sequence[int]], str] = None,
    on_cycle: Callable[[CycleInfo], None] | None = None,
) -> list[SMCResult]:
    """Run SMC-SD for several requests at once, each with ``config.n_particles`` particles.

    Every cycle steps all live particles of all requests; their draft forwards and the
    one fused target forward are shared through the engine. Resampling is per request.

    Args:
        programs: one initial ``SMCSDModel`` per request (copied into N particles).
        engine: the block engine holding the draft and target backends.
        encode: text -> token ids, for programs whose prompt is a string.
        decode: token ids -> text, for ``particle.text``.
        on_cycle: called after every cycle with a ``CycleInfo``.
    """
    cfg = engine.config
    decode = decode or (lambda ids: " ".join(map(str, ids)))
    prompts = [_prompt_ids(p.prompt, encode) for p in programs]
    barrier = _barrier(engine)
    runtime = Runtime(engine, barrier, cfg.max_new_tokens, decode)
    schedules = [
        engine.record.schedule(cfg.block_size, cfg.n_particles, p.plain, engine.draft_cost)
        if cfg.cut is not None
        else None
        for p in programs
    ]
    plans = [(None, cfg.n_particles) if s is None else (s.next_length(), s.n_particles()) for s in schedules]
    drafting = any(length != 0 for length, _ in plans)
    constraints = [p.constraint for p in programs]
    x0, log_z0 = engine.start(prompts, [n for _, n in plans], constraints, draft=drafting)
    pops = _populations(programs, runtime, plans, schedules, x0, log_z0)
    await asyncio.gather(*(p.start() for pop in pops for p in pop.particles))
    cycle = 0
    while any(not p.done_stepping() for pop in pops for p in pop.particles):
        ess_now, resampled = await _cycle(pops, barrier, engine)
        cycle += 1
        if on_cycle is not None:
            longest = max(len(p.token_ids) for pop in pops for p in pop.particles)
            n_live = sum(not p.done_stepping() for pop in pops for p in pop.particles)
            on_cycle(CycleInfo(cycle, n_live, longest, ess_now, resampled))
    for s in schedules:
        if s is not None:
            engine.record.update(s)
    return [_result(pop, cfg, engine.g_cpu) for pop in pops]


def _barrier(engine: BlockEngine) -> CycleBarrier:
    """The cycle's two shared calls: every particle's draft request, then every block to verify."""
    k = engine.config.block_size
    return CycleBarrier(
        {
            "draft": lambda items: engine.draft_blocks(
                [r for r, *_ in items],
                [b for _, b, *_ in items],
                constraints=[c for _, _, c, _ in items],
                limits=[k if n is None else n for *_, n in items],
            ),
            "target": engine.verify_blocks,
        }
    )


def _populations(programs, runtime, plans, schedules, x0, log_z0) -> list[_Population]:
    """Each request's particles, copies of its program that start from its first token x0."""
    engine, pops, row = runtime.engine, [], 0
    for i, program in enumerate(programs):
        program.runtime = runtime
        particles = [copy.deepcopy(program) for _ in range(plans[i][1])]
        for p in particles:
            p.row, p.token_ids, p.draft_limit = row, [x0[i]], plans[i][0]
            row += 1
            if x0[i] in engine.eos or runtime.max_new_tokens == 1:
                p.finish()
        if schedules[i] is not None and all(p.finished for p in particles):
            schedules[i].lengths.clear()  # no cycle will run
        pops.append(_Population(particles, log_z=log_z0[i], schedule=schedules[i]))
    return pops


async def _cycle(pops: list[_Population], barrier: CycleBarrier, engine: BlockEngine):
    """Step every live particle once, then reweigh, resample and resize each request.

    Returns the ESS of each request before resampling and whether it resampled.
    """
    live = [p for pop in pops for p in pop.particles if not p.done_stepping()]
    for pop in pops:
        for p in pop.particles:
            p.untwist()
    before = {id(p): p.last_block for p in live}
    await _step_all(live, barrier)
    ess_now, resampled = [], []
    for pop in pops:
        _observe(pop, before)
        e, did = _maybe_resample(pop, engine.config, engine.g_cpu)
        ess_now.append(e)
        resampled.append(did)
        _adapt(pop, engine.g_cpu)
    _pack_rows(pops, engine)
    return ess_now, resampled


def run_smc_sd(programs: Sequence[SMCSDModel], engine: BlockEngine, **kwargs) -> list[SMCResult]:
    """Synchronous wrapper of ``smc_sd`` (use the coroutine inside a running event loop)."""
    return asyncio.run(smc_sd(programs, engine, **kwargs))


def _prompt_ids(prompt, encode) -> list[int]:
    if isinstance(prompt, str):
        if encode is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or an encode function")
        return encode(prompt)
    return [int(t) for t in prompt]


async def _step_all(live: list[SMCSDModel], barrier: CycleBarrier) -> None:
    barrier.open(len(live))

    async def step(p: SMCSDModel) -> None:
        try:
            await p.step()
        finally:
            barrier.leave()

    outcomes = await asyncio.gather(*(step(p) for p in live), return_exceptions=True)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    if errors:
        raise errors[0]


def _maybe_resample(pop: _Population, cfg: SMCConfig, g: torch.Generator) -> tuple[float, bool]:
    log_w = pop.log_weights()
    n = len(pop.particles)
    if not torch.isfinite(log_w).any():
        pop.ess_trace.append(0.0)
        return 0.0, False  # every particle is dead; nothing to resample from
    e = smc.ess(log_w)
    pop.ess_trace.append(e)
    if n >= 2:
        pop.ess_fractions.append(e / n)
    if n < 2 or cfg.ess_threshold == 0 or e >= cfg.ess_threshold * n:
        return e, False
    ancestors = smc.resample(log_w, cfg.resampling, g).tolist()
    pop.log_z += smc.log_mean_exp(log_w)
    pop.particles = [copy.deepcopy(pop.particles[a]) for a in ancestors]
    for p in pop.particles:
        p.weight = 0.0
    pop.n_resamples += 1
    return e, True


def _observe(pop: _Population, before: dict[int, object]) -> None:
    """Feed the schedule the blocks this cycle's particles proposed (drafted ones only)."""
    if pop.schedule is None:
        return
    blocks = [
        p.last_block.drafted
        for p in pop.particles
        if id(p) in before and p.last_block is not before[id(p)] and p.last_block.drafted.tokens
    ]
    pop.schedule.observe([b.kept for b in blocks], [b.diverged for b in blocks])


def _adapt(pop: _Population, g: torch.Generator) -> None:
    """Set the next cycle's draft length; resize a plain request's population (1 or N particles).

    Shrinking selects one particle in proportion to its weight, like a resampling round
    down to one; growing copies a particle with its weight, which leaves every weighted
    estimate unchanged.
    """
    if pop.schedule is None or all(p.done_stepping() for p in pop.particles):
        return
    length, want = pop.schedule.next_length(), pop.schedule.n_particles()
    if want < len(pop.particles):
        log_w = pop.log_weights()
        if torch.isfinite(log_w).any():
            chosen = _draw_one(log_w, g)
            pop.log_z += smc.log_mean_exp(log_w)
            pop.particles = [pop.particles[chosen]]
            pop.particles[0].weight = 0.0
    elif want > len(pop.particles) == 1:
        pop.particles += [copy.deepcopy(pop.particles[0]) for _ in range(want - 1)]
    for p in pop.particles:
        p.draft_limit = length


def _pack_rows(pops: list[_Population], engine: BlockEngine) -> None:
    """One gather: live particles get consecutive rows; finished ones release theirs."""
    rows = []
    for pop in pops:
        for p in pop.particles:
            if p.done_stepping():
                p.row = -1
            else:
                rows.append(p.row)
                p.row = len(rows) - 1
    engine.reorder(rows)


def _result(pop: _Population, cfg: SMCConfig, g: torch.Generator) -> SMCResult:
    log_w = pop.log_weights()
    outs = [ParticleOut(list(p.token_ids), p.text, float(w)) for p, w in zip(pop.particles, log_w)]
    stats = dict(
        ess_trace=pop.ess_trace,
        n_resamples=pop.n_resamples,
        collapsed=bool(pop.ess_fractions) and statistics.fmean(pop.ess_fractions) < COLLAPSE_ESS_FRACTION,
        draft_lengths=list(pop.schedule.lengths) if pop.schedule else [],
    )
    if not torch.isfinite(log_w).any():
        msg = "every particle has zero weight: no particle satisfied the program's conditions"
        return SMCResult([], "", -math.inf, outs, -1, message=msg, **stats)
    log_z = pop.log_z + smc.log_mean_exp(log_w)
    if cfg.selection == "argmax":
        chosen = int(torch.argmax(log_w))
    else:
        chosen = _draw_one(log_w, g)
    best = outs[chosen]
    msg = _cut_short(pop.particles[chosen])
    return SMCResult(best.token_ids, best.text, log_z, outs, chosen, message=msg, **stats)


def _draw_one(log_w: torch.Tensor, g: torch.Generator) -> int:
    """One particle index drawn in proportion to its weight."""
    return int(torch.multinomial(smc.normalize(log_w), 1, generator=g))


def _cut_short(p: SMCSDModel) -> str:
    """Say so when the budget ended a constrained output before the constraint was met."""
    c, ids = p.constraint, p.token_ids
    if c is None or p.runtime is None or len(ids) < p.runtime.max_new_tokens:
        return ""
    eos = p.runtime.engine.eos
    if ids and ids[-1] in eos:
        return ""
    # Could it end here? Then the output satisfies the constraint (without EOS ids: ask it).
    if allows(c, [[*ids, min(eos)]])[0] if eos else getattr(c, "is_complete", lambda _: True)(ids):
        return ""
    return (
        f"incomplete: max_new_tokens ({p.runtime.max_new_tokens}) ran out before the constraint was "
        "met; the text is only a prefix of a valid output (raise max_new_tokens)"
    )

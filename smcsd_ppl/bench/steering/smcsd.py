"""SMC-SD as a steering method: the constrained program, the plain one, and plain plus rejection."""

from __future__ import annotations

import math
import time

import torch

from ...config import SMCConfig
from ...inference.program import SMCSDModel
from ...methods.registry import RunContext
from .base import SteeringRecord, as_constraint, finish, select


def _smcsd(ctx, program, task, name, *, temperature, **settings):
    """Run one SMC-SD program under the call's settings; the record keeps SMC-SD's own log Z.

    ``settings`` are ``SMCConfig`` fields (N, K, budget, seed, cut, ignore_eos); ``temperature``
    is both models' T.
    """
    config = SMCConfig(draft_temperature=temperature, target_temperature=temperature, **settings)
    # The program holds its prompt; the engine follows this call's config (ignore_eos included).
    ctx.target_lm.stats.reset()
    start = time.perf_counter()
    [ticket] = ctx.engine.run([program], config, record=ctx.draft_record)
    info = ticket.wait().smc
    seconds, particles = time.perf_counter() - start, info.particles
    ids, log_w = [p.token_ids for p in particles], [p.log_weight for p in particles]
    rec = finish(name, ctx, task, ids, log_w, seconds, config.seed)
    rec.target_calls = ctx.target_lm.stats.passes
    rec.log_z = info.log_z  # the final weights' evidence, every resampling round's included
    return rec


def smcsd_constrained(
    ctx: RunContext, prompt, constraint, *, mode="proposal", block_size=8, **kw
) -> SteeringRecord:
    """SMC-SD program ``SMCSDModel(prompt, constraint, mode)``; ``kw`` as for ``llamppl_smc``."""
    task = as_constraint(ctx, constraint)
    program = SMCSDModel(prompt, task.tokens, mode)
    return _smcsd(ctx, program, task, f"smcsd_{mode}", block_size=block_size, **_defaults(kw))


def smcsd_filtered(ctx: RunContext, prompt, constraint, *, seed=0, **kw) -> SteeringRecord:
    """SMC-SD without the constraint, then rejection: only valid particles may be returned.

    ``validity`` is the share of the N returned particles that satisfy the constraint;
    ``log_z`` becomes the unconstrained log Z plus the log of the valid weight share,
    an estimate of the constrained normalizer (-inf when no particle is valid).
    """
    rec = smcsd_plain(ctx, prompt, constraint, seed=seed, **kw)
    rec.method = "smcsd_filtered"
    log_w = torch.tensor(rec.log_weights, dtype=torch.float64)
    kept = log_w.masked_fill(~torch.tensor(rec.valid, dtype=torch.bool), -math.inf)
    log_z = rec.log_z
    rec.message = "" if torch.isfinite(kept).any() else "no particle satisfies the constraint"
    select(rec, kept, seed)
    if torch.isfinite(kept).any():
        rec.log_z = log_z + float(torch.logsumexp(kept, 0) - torch.logsumexp(log_w, 0))
    return rec


def smcsd_plain(
    ctx: RunContext, prompt, constraint, *, block_size=8, ignore_eos=False, **kw
) -> SteeringRecord:
    """SMC-SD without the constraint (validity still checked), the same loop: the speed reference.

    ``ignore_eos`` emits exactly ``max_new_tokens`` tokens (for length-matched timing).
    """
    task = as_constraint(ctx, constraint)
    program = EveryParticle(prompt)
    return _smcsd(
        ctx, program, task, "smcsd_plain", block_size=block_size, ignore_eos=ignore_eos, **_defaults(kw)
    )


class EveryParticle(SMCSDModel):
    """The plain program, kept at N particles even where it decodes alone (filtering needs all N)."""

    plain = False  # never decode alone with one particle, as the plain program may

    async def step(self) -> None:
        """One block, as the plain program."""
        await self.extend()


def _defaults(kw: dict) -> dict:
    return {"temperature": 1.0, "seed": 0, **kw}

"""Constrained-generation baselines: LLaMPPL and genlm-control SMC next to SMC-SD.

Every runner takes the same inputs (a ``RunContext`` of the pair, a text prompt, a
constraint, N, a token budget, one temperature T for every model, a seed) and returns a
``SteeringRecord``; ``SMCSD.context()`` builds the context:

* ``llamppl_smc``: a ``llamppl.Model`` sampling token by token from the target
  (``CachedCausalLM`` over genlm-backend's ``AsyncTransformer`` built from the in-memory
  model), the constraint as ``self.condition`` on each prefix; ``masked=True`` instead
  observes the allowed-token mask first (LLaMPPL's ``mask_dist`` idiom), a token-level
  proposal restricted to allowed tokens. Run with ``smc_standard``.
* ``genlm_smc``: genlm-control's ``SMC`` with ``AWRS(llm, constraint)``,
  ``direct_token_sampler(llm * constraint)``, or the critic variant
  ``SMC(direct_token_sampler(llm), critic=constraint)``.
* ``smcsd_filtered``: SMC-SD without the constraint, then rejection of invalid particles.
* ``smcsd_constrained`` (mode ``proposal`` / ``critic``) and ``smcsd_plain``: SMC-SD programs.

The token-level libraries share one ``AsyncTransformer`` per pair; its caches are
cleared before every run, its auto-batch size is set to N (a batch leaves as soon as
every particle has asked) and only the prompt's KV is cached, as those libraries do.
``seconds`` covers the SMC call, prompt prefill included; building vocabularies,
coercions and compiled constraints once per pair or constraint is not timed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import re
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from .. import smc
from ..config import SMCConfig
from ..inference.program import SMCSDModel
from ..potentials import PotentialConstraint, RegexConstraint
from .registry import RunContext
from .smcsd import run_programs


@dataclass
class SteeringRecord:
    """One run of one method on one prompt.

    Attributes:
        text: the selected particle (EOS dropped); sampled by final weight.
        token_ids: the selected particle's tokens (EOS dropped).
        texts: every final particle's text (EOS dropped).
        particle_ids: every final particle's tokens (EOS dropped).
        lengths: tokens each particle generated, a final EOS included (it costs a step too).
        log_weights: final log-weight of each particle.
        valid: whether each final particle has positive weight and satisfies the
            constraint (``TaskConstraint.check``).
        chosen: index of the selected particle (-1 when every weight is zero).
        seconds: wall time of the SMC call.
        log_z: the method's log normalizer estimate (log marginal likelihood).
        ess: effective sample size of the final weights.
    """

    method: str
    text: str
    token_ids: list[int]
    texts: list[str]
    particle_ids: list[list[int]]
    lengths: list[int]
    log_weights: list[float]
    valid: list[bool]
    chosen: int
    seconds: float
    log_z: float | None = None
    ess: float | None = None
    message: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def validity(self) -> float:
        """Share of final particles that satisfy the constraint."""
        return sum(self.valid) / len(self.valid) if self.valid else 0.0

    @property
    def tokens(self) -> float:
        """Mean generated tokens per particle (a final EOS included)."""
        return float(np.mean(self.lengths)) if self.lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Tokens of one sequence per wall second (``tokens / seconds``)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def selected_valid(self) -> bool:
        """The returned text satisfies the constraint."""
        return self.chosen >= 0 and self.valid[self.chosen]


class TaskConstraint:
    """A regex or a genlm-control byte potential, in every form the runners need.

    Args:
        tokenizer: the target's tokenizer.
        eos_token_ids: the EOS ids (allowed once the text is complete).
        pattern: a regex (Python ``re`` syntax, matched against the whole stripped text)
            or a genlm-control ``Potential`` over bytes.
        meaning: what the text must also mean to count as valid (a real calendar date, JSON
            that parses into the schema), beyond the form the constraint enforces; None: form only.
    """

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], pattern, meaning=None) -> None:
        self.pattern, self.meaning = pattern, meaning
        self.regex = pattern if isinstance(pattern, str) else None
        if self.regex is not None:
            from genlm.control import BoolFSA

            self.tokens = RegexConstraint(pattern, tokenizer, eos_token_ids)
            self.potential = BoolFSA.from_regex(pattern)
        else:
            self.tokens = PotentialConstraint(pattern, tokenizer, eos_token_ids)
            self.potential = pattern

    def check(self, text: str) -> bool:
        """The whole (stripped) text satisfies the constraint, and means what it must."""
        text = text.strip()
        if self.regex is not None:
            ok = re.fullmatch(self.regex, text) is not None
        else:
            ok = asyncio.run(self.potential.complete(list(text.encode()))) > -math.inf
        return ok and (self.meaning is None or self.meaning(text))

    def allows(self, ids: Sequence[int]) -> bool:
        """The last token of ``ids`` is allowed after the ones before it."""
        return bool(self.tokens.next_mask([list(ids[:-1])])[0, ids[-1]])

    def mask(self, ids: Sequence[int]) -> set[int]:
        """Token ids allowed after ``ids``."""
        return set(torch.nonzero(self.tokens.next_mask([list(ids)])[0]).flatten().tolist())


def as_constraint(ctx: RunContext, constraint) -> TaskConstraint:
    """``constraint`` itself if it is a ``TaskConstraint``, else one built on the context's target."""
    if isinstance(constraint, TaskConstraint):
        return constraint
    return TaskConstraint(ctx.target_model.tokenizer, ctx.eos, constraint)


_ASYNC_LMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def async_lm(ctx: RunContext):
    """The context's target as a genlm-backend ``AsyncTransformer`` (built once per model, no hub)."""
    target = ctx.target_model
    if target.model not in _ASYNC_LMS:
        from genlm.backend.llm import AsyncTransformer
        from llamppl import CachedCausalLM

        backend = AsyncTransformer(target.model, target.tokenizer)
        _ASYNC_LMS[target.model] = (backend, CachedCausalLM(backend))
    return _ASYNC_LMS[target.model]


def _fresh(ctx: RunContext, n_particles: int, seed: int):
    """Reset the shared backend, seed every RNG; returns (backend, cached LM)."""
    backend, lm = async_lm(ctx)
    backend.clear_cache()
    backend.reset_async_queries()
    backend.batch_size = n_particles
    np.random.seed(seed)
    random.seed(seed)
    torch.manual_seed(seed)
    return backend, lm


def _finish(method, ctx, task, ids_per_particle, log_w, seconds, seed, lengths=None) -> SteeringRecord:
    """Drop EOS, decode, check, pick the output by final weight; log Z and ESS from ``log_w``."""
    eos = set(ctx.eos)
    lengths = [len(p) for p in ids_per_particle] if lengths is None else lengths
    ids = [[int(t) for t in p if int(t) not in eos] for p in ids_per_particle]
    texts = [ctx.decode(p) for p in ids]
    w = smc.clean_log_weights(torch.tensor(log_w, dtype=torch.float64))
    # A zero-weight particle is not an output, even if its (cut) text happens to match.
    valid = [bool(torch.isfinite(x)) and task.check(t) for x, t in zip(w, texts)]
    rec = SteeringRecord(method, "", [], texts, ids, lengths, w.tolist(), valid, -1, seconds)
    _select(rec, w, seed)
    return rec


def _select(rec: SteeringRecord, log_w: torch.Tensor, seed: int) -> None:
    """Sample the output particle by weight; set log Z (log-mean-exp) and ESS of ``log_w``."""
    if not torch.isfinite(log_w).any():
        rec.text, rec.token_ids, rec.chosen, rec.ess, rec.log_z = "", [], -1, 0.0, -math.inf
        rec.message = rec.message or "every particle has zero weight"
        return
    rec.ess, rec.log_z = float(smc.ess(log_w)), float(smc.log_mean_exp(log_w))
    g = torch.Generator().manual_seed(seed)
    rec.chosen = int(torch.multinomial(smc.normalize(log_w), 1, generator=g))
    rec.text, rec.token_ids = rec.texts[rec.chosen], rec.particle_ids[rec.chosen]


def llamppl_smc(
    ctx: RunContext, prompt, constraint, *, n_particles, max_new_tokens, temperature=1.0, seed=0, masked=False
) -> SteeringRecord:
    """LLaMPPL ``smc_standard`` over a token-by-token target program (see the module doc)."""
    from llamppl import LMContext, Model, smc_standard

    task = as_constraint(ctx, constraint)
    prompt_ids = ctx.encode(prompt)
    eos = set(ctx.eos)

    class TokenProgram(Model):
        def __init__(self, lm_ctx):
            super().__init__()
            self.ctx, self.ids = lm_ctx, []

        async def step(self):
            if masked:  # weight by the allowed mass, then sample among allowed tokens
                await self.observe(self.ctx.mask_dist(task.mask(self.ids)), True)
            token = await self.sample(self.ctx.next_token())
            self.ids.append(int(token.token_id))
            self.condition(task.allows(self.ids))
            if self.ids[-1] in eos or len(self.ids) >= max_new_tokens:
                self.finish()

    backend, lm = _fresh(ctx, n_particles, seed)

    prompt_text = lm.tokenizer.decode(prompt_ids)  # LMContext takes text: chat-template ids, decoded
    if lm.tokenizer.encode(prompt_text) != list(prompt_ids):
        raise ValueError("the prompt's token ids do not survive decoding and encoding: LLaMPPL takes text")

    async def go():
        lm.cache_kv(prompt_ids)
        lm_ctx = await LMContext.create(lm, prompt_text, temperature)
        return await smc_standard(TokenProgram(lm_ctx), n_particles, 0.5, resampling_method="systematic")

    start = time.perf_counter()
    ps = asyncio.run(go())
    name = "llamppl_masked" if masked else "llamppl_smc"
    return _finish(
        name, ctx, task, [p.ids for p in ps], [p.weight for p in ps], time.perf_counter() - start, seed
    )


GENLM_SAMPLERS = ("awrs", "direct", "critic")


def genlm_smc(
    ctx: RunContext,
    prompt,
    constraint,
    *,
    n_particles,
    max_new_tokens,
    temperature=1.0,
    seed=0,
    sampler="awrs",
) -> SteeringRecord:
    """genlm-control ``SMC``: ``sampler`` is ``awrs``, ``direct`` (llm x constraint) or ``critic``."""
    from genlm.control import AWRS, SMC, PromptedLLM, direct_token_sampler

    if sampler not in GENLM_SAMPLERS:
        raise ValueError(f"sampler must be one of {GENLM_SAMPLERS}, got {sampler!r}")
    task = as_constraint(ctx, constraint)
    prompt_ids = ctx.encode(prompt)
    backend, _ = _fresh(ctx, n_particles, seed)
    eos_bytes = [backend.byte_vocab[i].byte_string for i in ctx.eos]
    llm = PromptedLLM(backend, prompt_ids=prompt_ids, eos_byte_strings=eos_bytes, temperature=temperature)
    condition = task.potential.coerce(llm, f=b"".join)
    if sampler == "awrs":
        smc_run = SMC(AWRS(llm, condition, seed=seed))
    elif sampler == "direct":
        smc_run = SMC(direct_token_sampler(llm * condition))
    else:
        smc_run = SMC(direct_token_sampler(llm), critic=condition)

    async def go():
        backend.cache_kv(prompt_ids)
        try:  # max_tokens counts the closing EOS, as max_new_tokens does for the other runners
            return await smc_run(n_particles, 0.5, max_new_tokens, resampling_method="systematic")
        finally:
            await smc_run.cleanup()

    start = time.perf_counter()
    seqs = asyncio.run(go())
    ids = [[t.token_id for t in seq if hasattr(t, "token_id")] for seq in seqs.contexts]  # EOS has none
    seconds, lengths = time.perf_counter() - start, [len(seq) for seq in seqs.contexts]
    rec = _finish(f"genlm_{sampler}", ctx, task, ids, list(seqs.log_weights), seconds, seed, lengths)
    rec.log_z, rec.ess = float(seqs.log_ml), float(seqs.ess)  # the library's own estimates
    return rec


def _smcsd(ctx, program, task, name, *, n_particles, max_new_tokens, temperature, seed, block_size, **cfg):
    """Run one SMC-SD program under the call's settings; the record keeps SMC-SD's own log Z."""
    config = SMCConfig(
        n_particles=n_particles,
        block_size=block_size,
        draft_temperature=temperature,
        target_temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        **cfg,
    )
    # The program holds its prompt; the engine follows this call's config (ignore_eos included).
    run_ctx = dataclasses.replace(ctx, prompts=[], config=config, on_progress=None)
    ctx.target_lm.stats.reset()
    start = time.perf_counter()
    (info,) = run_programs(run_ctx, [program]).info
    seconds, particles = time.perf_counter() - start, info.particles
    ids, log_w = [p.token_ids for p in particles], [p.log_weight for p in particles]
    rec = _finish(name, ctx, task, ids, log_w, seconds, seed)
    rec.extra = {
        "n_resamples": info.n_resamples,
        "mean_ess": info.mean_ess,
        "target_calls": ctx.target_lm.stats.calls,
    }
    rec.log_z = info.log_z  # includes the log Z increments of earlier resampling rounds
    return rec


def smcsd_constrained(
    ctx: RunContext, prompt, constraint, *, mode="proposal", block_size=8, **kw
) -> SteeringRecord:
    """SMC-SD program ``SMCSDModel(prompt, constraint, mode)``; ``kw`` as for ``llamppl_smc``."""
    task = as_constraint(ctx, constraint)
    program = SMCSDModel(prompt, task.tokens, mode)
    return _smcsd(ctx, program, task, f"smcsd_{mode}", block_size=block_size, **_defaults(kw))


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

    async def step(self) -> None:
        """One block, as the plain program."""
        await self.extend()


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
    _select(rec, kept, seed)
    if torch.isfinite(kept).any():
        rec.log_z = log_z + float(torch.logsumexp(kept, 0) - torch.logsumexp(log_w, 0))
    return rec


def _defaults(kw: dict) -> dict:
    return {"temperature": 1.0, "seed": 0, **kw}


SteeringRunner = Callable[..., SteeringRecord]
STEERING_METHODS: dict[str, SteeringRunner] = {
    "smcsd_proposal": partial(smcsd_constrained, mode="proposal"),
    "smcsd_critic": partial(smcsd_constrained, mode="critic"),
    "smcsd_filtered": smcsd_filtered,
    "smcsd_plain": smcsd_plain,
    "llamppl_smc": llamppl_smc,
    "llamppl_masked": partial(llamppl_smc, masked=True),
    "genlm_awrs": partial(genlm_smc, sampler="awrs"),
    "genlm_direct": partial(genlm_smc, sampler="direct"),
    "genlm_critic": partial(genlm_smc, sampler="critic"),
}
"""Every constrained-generation method by name: ``(ctx, prompt, constraint, **kw) -> SteeringRecord``."""

SMCSD_STEERING = tuple(name for name in STEERING_METHODS if name.startswith("smcsd_"))
"""The SMC-SD ones (they take a block size K and a quality cut)."""

"""Token-level steering by other libraries: LLaMPPL's ``smc_standard`` and genlm-control's ``SMC``.

Both draw from the global NumPy and torch generators (they take none): each run seeds them
inside ``seeded`` and gives the caller's states back afterwards. Both read the target through
genlm-backend's ``AsyncTransformer``; a ``TokenLMs`` the caller keeps builds it once per model.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ...methods.registry import RunContext
from .base import SteeringRecord, as_constraint, finish


class TokenLMs:
    """The targets as genlm-backend ``AsyncTransformer`` and LLaMPPL ``CachedCausalLM``, built once each.

    Building one reads the whole vocabulary as bytes: a caller running many token-level runs on
    one pair keeps one ``TokenLMs`` for them (a runner given none builds its own).
    """

    def __init__(self) -> None:
        self.built: dict = {}  # the target's torch model -> (backend, cached LM)

    def get(self, ctx: RunContext):
        """The context's target as (``AsyncTransformer``, ``CachedCausalLM``); no hub is read."""
        model = ctx.built_models("a token-level steering method")[0].model
        if model not in self.built:
            from genlm.backend.llm import AsyncTransformer
            from llamppl import CachedCausalLM

            backend = AsyncTransformer(model, ctx.target_model.tokenizer)
            self.built[model] = (backend, CachedCausalLM(backend))
        return self.built[model]

    def fresh(self, ctx: RunContext, n_particles: int):
        """``get``, its caches cleared and its auto-batch set to ``n_particles``."""
        backend, lm = self.get(ctx)
        backend.clear_cache()
        backend.reset_async_queries()
        backend.batch_size = n_particles
        return backend, lm


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """The global Python, NumPy and torch generators seeded with ``seed``; restored on exit."""
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
            np.random.seed(seed)
            random.seed(seed)
            torch.manual_seed(seed)
            yield
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


@dataclass(frozen=True)
class TokenRun:
    """The settings of one token-level run (the keywords every runner here takes).

    Attributes:
        n_particles: N.
        max_new_tokens: the budget, a closing EOS included.
        temperature: the target's T.
        seed: seeds the libraries' draws and the output pick.
        lms: the target as those libraries read it (None: built for this run).
    """

    n_particles: int
    max_new_tokens: int
    temperature: float = 1.0
    seed: int = 0
    lms: TokenLMs | None = None

    def fresh(self, ctx: RunContext):
        """The target's (``AsyncTransformer``, ``CachedCausalLM``), reset for this run."""
        return (self.lms or TokenLMs()).fresh(ctx, self.n_particles)


def llamppl_smc(ctx: RunContext, prompt, constraint, *, masked=False, **kw) -> SteeringRecord:
    """LLaMPPL ``smc_standard`` over a token-by-token target program; ``kw``: ``TokenRun``'s fields."""
    from llamppl import LMContext, smc_standard

    run, task, prompt_ids = TokenRun(**kw), as_constraint(ctx, constraint), ctx.encode(prompt)
    program = _token_program(task, set(ctx.eos), run.max_new_tokens, masked)
    _, lm = run.fresh(ctx)
    prompt_text = lm.tokenizer.decode(prompt_ids)  # LMContext takes text: chat-template ids, decoded
    if lm.tokenizer.encode(prompt_text) != list(prompt_ids):
        raise ValueError("the prompt's token ids do not survive decoding and encoding: LLaMPPL takes text")

    async def go():
        lm.cache_kv(prompt_ids)
        lm_ctx = await LMContext.create(lm, prompt_text, run.temperature)
        return await smc_standard(program(lm_ctx), run.n_particles, 0.5, resampling_method="systematic")

    with seeded(run.seed):
        start = time.perf_counter()
        ps = asyncio.run(go())
        seconds = time.perf_counter() - start
    name = "llamppl_masked" if masked else "llamppl_smc"
    return finish(name, ctx, task, [p.ids for p in ps], [p.weight for p in ps], seconds, run.seed)


def _token_program(task, eos: set[int], max_new_tokens: int, masked: bool):
    """A LLaMPPL ``Model`` class sampling the target token by token under ``task``."""
    from llamppl import Model

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

    return TokenProgram


GENLM_SAMPLERS = ("awrs", "direct", "critic")


def genlm_smc(ctx: RunContext, prompt, constraint, *, sampler="awrs", **kw) -> SteeringRecord:
    """genlm-control ``SMC``, ``sampler`` ``awrs``, ``direct`` (llm x constraint) or ``critic``.

    ``kw``: ``TokenRun``'s fields.
    """
    from genlm.control import PromptedLLM

    if sampler not in GENLM_SAMPLERS:
        raise ValueError(f"sampler must be one of {GENLM_SAMPLERS}, got {sampler!r}")
    run, task, prompt_ids = TokenRun(**kw), as_constraint(ctx, constraint), ctx.encode(prompt)
    backend, _ = run.fresh(ctx)
    eos_bytes = [backend.byte_vocab[i].byte_string for i in ctx.eos]
    llm = PromptedLLM(backend, prompt_ids=prompt_ids, eos_byte_strings=eos_bytes, temperature=run.temperature)
    smc_run = _genlm_smc(sampler, llm, task.potential.coerce(llm, f=b"".join), run.seed)

    async def go():
        backend.cache_kv(prompt_ids)
        try:  # max_tokens counts the closing EOS, as max_new_tokens does for the other runners
            return await smc_run(run.n_particles, 0.5, run.max_new_tokens, resampling_method="systematic")
        finally:
            await smc_run.cleanup()

    with seeded(run.seed):
        start = time.perf_counter()
        seqs = asyncio.run(go())
        seconds = time.perf_counter() - start
    ids = [[t.token_id for t in seq if hasattr(t, "token_id")] for seq in seqs.contexts]  # EOS has none
    lengths = [len(seq) for seq in seqs.contexts]
    rec = finish(f"genlm_{sampler}", ctx, task, ids, list(seqs.log_weights), seconds, run.seed, lengths)
    rec.log_z, rec.ess = float(seqs.log_ml), float(seqs.ess)  # the library's own estimates
    return rec


def _genlm_smc(sampler: str, llm, condition, seed: int):
    """genlm-control's ``SMC`` with the named token sampler (AWRS draws from its own seeded generator)."""
    from genlm.control import AWRS, SMC, direct_token_sampler

    if sampler == "awrs":
        return SMC(AWRS(llm, condition, seed=seed))
    if sampler == "direct":
        return SMC(direct_token_sampler(llm * condition))
    return SMC(direct_token_sampler(llm), critic=condition)

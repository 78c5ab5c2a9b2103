"""``smcsd_ppl.llamppl`` offers every public name of ``llamppl``, and llamppl's own objects work here."""

from __future__ import annotations

import asyncio
import types

import llamppl
import numpy as np
import pytest
from helpers import EOS
from llamppl_side import TheirMockLM, mock_lm

import smcsd_ppl.llamppl as ours

OWN = {"CachedCausalLM", "LMContext", "Model", "smc_standard", "smc_steer"}


def test_every_public_name_of_llamppl_is_offered():
    """Fails when llamppl gains a public name (or loses one) that this module does not follow."""
    theirs = ours.llamppl_public_names()
    assert theirs == set(ours.__all__), (
        sorted(theirs - set(ours.__all__)),
        sorted(set(ours.__all__) - theirs),
    )
    assert all(hasattr(ours, name) for name in ours.__all__)
    for name in theirs - OWN:  # the rest are llamppl's own objects, unchanged
        assert getattr(ours, name) is getattr(llamppl, name), name
    for name in OWN:
        assert getattr(ours, name) is not getattr(llamppl, name), name


def test_public_names_are_what_dir_shows_less_modules_underscores_and_imports():
    fake = types.ModuleType("llamppl")

    def sample_sentence():
        """A name llamppl might add."""

    sample_sentence.__module__ = "llamppl.chunks"
    fake.sample_sentence, fake.np, fake._private, fake.FLAG = sample_sentence, np, 1, True
    fake.defaultdict = __import__("collections").defaultdict
    assert ours.llamppl_public_names(fake) == {"sample_sentence", "FLAG"}


def program(Model, LMContext):
    """A program drawing with llamppl's distributions and a submodel; it keeps what it drew."""

    @llamppl.submodel
    async def two_tokens(self, ctx):
        for _ in range(2):
            token = await self.sample(llamppl.LogCategorical(np.log([0.6, 0.3, 0.1, 1e-9])))
            await self.observe(ctx.next_token(), int(token))

    class Draws(Model):
        def __init__(self, lm):
            super().__init__()
            self.context = LMContext(lm, [0, 1])
            self.lm, self.draws = lm, []

        async def step(self):
            n = await self.sample(llamppl.Geometric(0.5))
            self.draws = [*self.draws, n]
            await self.observe(llamppl.Bernoulli(0.3), n > 1)
            token = await self.sample(llamppl.TokenCategorical(self.lm, np.array([0.0, 1.0, 2.0, -9.0])))
            await self.observe(self.context.next_token(), token)
            await self.call(two_tokens(self.context))
            if self.context.token_count >= 6:
                self.finish()

    return Draws


def meant_weight(target, particle, generated) -> float:
    """LLaMPPL's weight of a particle of ``Draws``: what it observed, nothing for what it sampled."""
    ids = [0, 1, *generated]
    lm_part = sum(float(target.next_logits(ids[:j]).log_softmax(-1)[ids[j]]) for j in range(2, len(ids)))
    return lm_part + sum(np.log(0.3) if n > 1 else np.log(0.7) for n in particle.draws)


def test_llamppl_distributions_and_submodels_weigh_as_in_llamppl():
    # Both libraries run the program (no resampling); each particle's weight must be what
    # LLaMPPL's semantics give its draws. Draw orders differ (our barrier resumes particles in
    # another order), so the particles themselves are not compared one to one.
    lm = mock_lm()
    target = lm.pair.target_lm
    np.random.seed(0)
    mine = asyncio.run(ours.smc_standard(program(ours.Model, ours.LMContext)(lm), 6, 0.0))
    Theirs = program(llamppl.Model, llamppl.LMContext)
    with np.errstate(divide="ignore"):  # LLaMPPL's log of an ESS threshold of 0
        theirs = asyncio.run(llamppl.smc_standard(Theirs(TheirMockLM(target)), 6, 0.0))
    for p in mine:
        assert len(p.draws) == 2 and len(p.context.generated) == 6
        assert p.weight == pytest.approx(meant_weight(target, p, p.context.generated), abs=1e-4)
    for p in theirs:
        assert p.weight == pytest.approx(meant_weight(target, p, p.context.tokens[2:]), abs=1e-4)
    assert len({tuple(p.context.generated) for p in mine}) > 1


def test_a_word_sampler_and_token_sequences_work_on_our_contexts():
    lm = mock_lm([" ab", "cd", "!", "</s>"])

    class Words(ours.Model):
        def __init__(self):
            super().__init__()
            self.context = ours.LMContext(lm, [0])
            self.words = []

        async def step(self):
            self.words.append(await self.call(ours.sample_word_2(self.context, allow_mid_punctuation=False)))
            if len(self.words) == 2:
                self.finish()

    for p in asyncio.run(ours.smc_standard(Words(), 4, max_new_tokens=32)):
        assert len(p.words) == 2 and all(w[0].startswith(" ab") for w in p.words if p.weight > -np.inf)
    seq = ours.TokenSequence(lm, [0, 1])
    assert str(seq) == " abcd" and seq.seq == [0, 1]


def test_transformer_is_refused_inside_a_run_with_what_to_use():
    lm = mock_lm()

    class Direct(ours.Model):
        def __init__(self):
            super().__init__()
            self.context = ours.LMContext(lm, [0, 1])

        async def step(self):
            await self.sample(ours.Transformer(lm, [0, 1]))

    with pytest.raises(ValueError, match=r"use context.next_token\(\)"):
        asyncio.run(ours.smc_standard(Direct(), 2))
    # outside a run, a Transformer reads the target as LLaMPPL's does
    lp = asyncio.run(ours.Transformer(lm, [0, 1]).log_prob(2))
    assert lp == pytest.approx(float(lm.pair.target_lm.next_logits([0, 1]).log_softmax(-1)[2]), abs=1e-6)
    assert EOS in lm.masks.EOS


def test_llamppls_resampling_method_keyword_is_read():
    lm = mock_lm()

    class Two(ours.Model):
        def __init__(self):
            super().__init__()
            self.context = ours.LMContext(lm, [0, 1])

        async def step(self):
            await self.sample(self.context.next_token())
            if self.context.token_count == 2:
                self.finish()

    particles = asyncio.run(ours.smc_standard(Two(), 3, 1.0, resampling_method="multinomial"))
    assert len(particles) == 3 and all(len(p.context.generated) == 2 for p in particles)
    with pytest.raises(ValueError, match="resampling"):
        asyncio.run(ours.smc_standard(Two(), 3, resampling_method="nope"))

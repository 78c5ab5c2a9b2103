"""LLaMPPL's own kinds of example programs, written as a LLaMPPL user writes them, with the import
changed to ``smcsd_ppl.llamppl``: every returned particle of positive weight keeps its constraint.

On the tiny random model only the constraints are judged, never the text's quality.
"""

from __future__ import annotations

import asyncio
import math
import re

import pytest

from smcsd_ppl.llamppl import CachedCausalLM, LMContext, Model, sample_word, smc_standard, smc_steer
from smcsd_ppl.potentials import RegexConstraint


@pytest.fixture(scope="module")
def lm(tiny_models):
    from smcsd_ppl.api import SMCSD

    return CachedCausalLM(SMCSD(*tiny_models))


def alive(particles):
    return [p for p in particles if p.weight > -math.inf]


class NoLetter(Model):
    """A hard constraint as LLaMPPL's README writes one: no token holding a forbidden letter."""

    def __init__(self, lm, prompt, letter):
        super().__init__()
        self.context = LMContext(lm, prompt)
        self.forbidden = {i for i, v in enumerate(lm.vocab) if letter in v}
        self.eos = lm.tokenizer.eos_token_id

    async def step(self):
        await self.observe(self.context.mask_dist(self.forbidden), False)
        token = await self.sample(self.context.next_token())
        if token.token_id == self.eos or self.context.token_count >= 10:
            self.finish()


@pytest.mark.parametrize("run", ["standard", "steer"])
def test_a_forbidden_letter_never_appears(lm, run):
    program = NoLetter(lm, "The quick brown fox", "e")
    go = smc_standard(program, 6) if run == "standard" else smc_steer(program, 3, 2)
    particles = alive(asyncio.run(go))
    assert particles
    for p in particles:
        assert not set(p.context.generated) & program.forbidden
        assert "e" not in str(p.context).replace(lm.tokenizer.eos_token, "")


VOWELS = re.compile(r"[aeiouy]+")


def syllables(word: str) -> int:
    """An offline syllable count: vowel groups, a final silent e dropped, at least one."""
    letters = "".join(c for c in word.lower() if c.isalpha())
    if not letters:
        return 0
    n = len(VOWELS.findall(letters))
    if letters.endswith("e") and not letters.endswith(("le", "ee")) and n > 1:
        n -= 1
    return max(n, 1)


class Haiku(Model):
    """LLaMPPL's haiku program: words from ``sample_word``, lines of so many syllables, observed breaks."""

    def __init__(self, lm, prompt, pattern):
        super().__init__()
        self.context = LMContext(lm, prompt)
        self.pattern = list(pattern)
        self.newline = lm.str_vocab.index("\n")
        self.eos = lm.tokenizer.eos_token_id
        self.lines = []  # the words of each line, as sample_word returned them

    async def step(self):
        left = self.pattern.pop(0)
        self.lines = [*self.lines, []]
        while left > 0:
            word, punctuation = await self.call(sample_word(self.context))
            self.lines[-1].append(word)
            left -= syllables(word)
            self.condition(left >= 0)
            if left < 0:
                self.finish()
                return
        if self.pattern:
            await self.observe(self.context.next_token(), self.newline)
        else:
            await self.observe(self.context.next_token(), self.eos)
            self.finish()


def test_every_haiku_has_its_syllables_per_line(lm):
    pattern = (3, 2)
    particles = alive(asyncio.run(smc_standard(Haiku(lm, "A poem about the sea", pattern), 8)))
    assert particles
    for p in particles:
        assert [sum(map(syllables, words)) for words in p.lines] == list(pattern), p.lines
        ids = p.context.generated
        assert (
            ids[-1] == lm.tokenizer.eos_token_id and ids.count(lm.str_vocab.index("\n")) == len(pattern) - 1
        )
        assert all(syllables(w) >= 1 for words in p.lines for w in words)


class Grammar(Model):
    """Grammar-constrained generation: the next token observed within the grammar's mask."""

    def __init__(self, lm, prompt, constraint):
        super().__init__()
        self.context = LMContext(lm, prompt)
        self.constraint = constraint
        self.eos = lm.tokenizer.eos_token_id

    async def step(self):
        mask = self.constraint.next_mask([self.context.generated])[0]
        await self.observe(self.context.mask_dist(mask), True)
        token = await self.sample(self.context.next_token())
        if token.token_id == self.eos:
            self.finish()


def test_every_grammar_constrained_output_matches_its_grammar(lm):
    pattern = r"(red|blue) (fish|cat)s?"
    constraint = RegexConstraint(pattern, lm.tokenizer, [lm.tokenizer.eos_token_id])
    program = Grammar(lm, "Name a thing:", constraint)
    particles = alive(asyncio.run(smc_standard(program, 6, max_new_tokens=16)))
    assert particles
    for p in particles:
        ids = p.context.generated
        assert ids[-1] == lm.tokenizer.eos_token_id
        assert re.fullmatch(pattern, lm.tokenizer.decode(ids[:-1])), lm.tokenizer.decode(ids)

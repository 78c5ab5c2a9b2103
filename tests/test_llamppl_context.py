"""The LMContext / CachedCausalLM surface side by side with LLaMPPL's, on one tiny model.

Each attribute LLaMPPL documents either equals LLaMPPL's on the same model and prompt, or is
refused with a one-line error naming what to use.
"""

from __future__ import annotations

import asyncio

import llamppl
import numpy as np
import pytest
from genlm.backend.llm import AsyncTransformer

import smcsd_ppl.llamppl as ours

PROMPT = "The quick brown fox"
MASKS = [
    "ALL_TOKENS",
    "STARTS_NEW_WORD",
    "CONTINUES_CURRENT_WORD",
    "PUNCTUATION",
    "CONTAINS_WHITESPACE",
    "EOS",
]


@pytest.fixture(scope="module")
def both(tiny_models):
    """(ours, LLaMPPL's) language model over the same tiny target."""
    target = tiny_models[0]
    from smcsd_ppl.api import SMCSD

    return ours.CachedCausalLM(SMCSD(*tiny_models)), llamppl.CachedCausalLM(
        AsyncTransformer(target.model, target.tokenizer)
    )


def test_the_language_model_holds_llamppls_vocabulary_masks_and_logprobs(both):
    mine, theirs = both
    assert mine.str_vocab == theirs.str_vocab and mine.vocab == theirs.str_vocab
    assert [t.byte_string for t in mine.byte_vocab] == [t.byte_string for t in theirs.byte_vocab]
    for name in MASKS:
        assert getattr(mine.masks, name) == getattr(theirs.masks, name), name
    assert mine.masks.token_length_mask(max=2) == theirs.masks.token_length_mask(max=2)
    ids = mine.tokenizer.encode(PROMPT)
    assert ids == theirs.tokenizer.encode(PROMPT)
    want = theirs.next_token_logprobs_unbatched(ids)
    assert np.allclose(mine.next_token_logprobs_unbatched(ids), want, atol=1e-4)
    assert np.allclose(asyncio.run(mine.next_token_logprobs(ids)), want, atol=1e-4)
    for accepted in (mine.clear_cache, mine.clear_kv_cache, mine.reset_async_queries):
        accepted()
    mine.cache_kv(ids)


def test_a_new_context_holds_llamppls_attributes(both):
    mine, theirs = both
    pairs = [
        (ours.LMContext(mine, PROMPT, show_prompt=True), llamppl.LMContext(theirs, PROMPT, show_prompt=True)),
        (
            asyncio.run(ours.LMContext.create(mine, PROMPT, temp=0.7)),
            asyncio.run(llamppl.LMContext.create(theirs, PROMPT, temp=0.7)),
        ),
    ]
    for a, b in pairs:
        assert a.tokens == b.tokens and a.temp == b.temp and a.token_count == b.token_count == 0
        assert (a.show_prompt, a.show_eos) == (b.show_prompt, b.show_eos)
        assert a.prompt_token_count == b.prompt_token_count
        assert a.prompt_string_length == b.prompt_string_length
        assert a.model_mask == b.model_mask and str(a) == str(b)
        assert np.allclose(a.next_token_logprobs, b.next_token_logprobs, atol=1e-4)


def forced(Model, LMContext, lm, tokens, **shown):
    """A program that writes ``tokens`` (EOS last) with ``intervene`` and stops."""

    class Forced(Model):
        def __init__(self):
            super().__init__()
            self.context = LMContext(lm, PROMPT, **shown)

        async def step(self):
            for t in tokens:
                await self.intervene(self.context.next_token(), t)
            self.finish()

    return Forced()


@pytest.mark.parametrize("shown", [{}, {"show_prompt": True}, {"show_eos": False}])
def test_a_context_after_a_run_reads_as_llamppls(both, shown):
    mine, theirs = both
    eos = mine.tokenizer.eos_token_id
    tokens = [*mine.tokenizer.encode(" jumps over the lazy dog."), eos]
    [a] = asyncio.run(ours.smc_standard(forced(ours.Model, ours.LMContext, mine, tokens, **shown), 1))
    [b] = asyncio.run(
        llamppl.smc_standard(forced(llamppl.Model, llamppl.LMContext, theirs, tokens, **shown), 1)
    )
    a, b = a.context, b.context
    assert a.tokens == [int(t) for t in b.tokens] and a.token_count == b.token_count
    assert str(a) == str(b)


def test_what_does_not_exist_here_is_refused_in_one_line(both):
    mine, _ = both
    with pytest.raises(ValueError, match="lm.pair.target_lm") as err:
        _ = mine.model
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="from_pretrained"):
        ours.CachedCausalLM(AsyncTransformer.__new__(AsyncTransformer))

    class Late(ours.Model):
        def __init__(self):
            super().__init__()
            self.context = ours.LMContext(mine, PROMPT)

        async def step(self):
            self.finish()

    [late] = asyncio.run(ours.smc_standard(Late(), 1))
    with pytest.raises(ValueError, match="inside a step") as err:
        _ = late.context.next_token_logprobs
    assert "\n" not in str(err.value)


def proposal_program(Model, LMContext, TokenCategorical, lm):
    """LLaMPPL's hard-constraint idiom: a proposal built from ``next_token_logprobs`` in each step."""

    class Proposed(Model):
        def __init__(self):
            super().__init__()
            self.context = LMContext(lm, [0, 1])
            self.read = []

        async def step(self):
            logits = self.context.next_token_logprobs.copy()
            self.read = [*self.read, logits.copy()]
            logits[[2, 3]] = -np.inf  # only tokens 0 and 1 proposed
            await self.sample(self.context.next_token(), proposal=TokenCategorical(lm, logits))
            if self.context.token_count == 4:
                self.finish()

    return Proposed()


def test_next_token_logprobs_inside_steps_is_llamppls():
    from llamppl_side import TheirMockLM, mock_lm

    lm = mock_lm()
    for seed in range(3):
        np.random.seed(seed)
        mine = asyncio.run(
            ours.smc_standard(proposal_program(ours.Model, ours.LMContext, ours.TokenCategorical, lm), 3, 0.0)
        )
        np.random.seed(seed)
        program = proposal_program(
            llamppl.Model, llamppl.LMContext, llamppl.TokenCategorical, TheirMockLM(lm.pair.target_lm)
        )
        with np.errstate(divide="ignore"):
            theirs = asyncio.run(llamppl.smc_standard(program, 3, 0.0))
        assert [p.context.generated for p in mine] == [[int(t) for t in p.context.tokens[2:]] for p in theirs]
        assert [p.weight for p in mine] == pytest.approx([p.weight for p in theirs], abs=1e-4)
        for a, b in zip(mine, theirs):
            assert np.allclose(np.stack(a.read), np.stack(b.read), atol=1e-5)

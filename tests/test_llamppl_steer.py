"""``smc_steer`` against LLaMPPL's own, output for output, on the mock model."""

from __future__ import annotations

import asyncio

import llamppl
import numpy as np
import pytest
from helpers import EOS
from llamppl.inference.smc_steer import resample_optimal
from llamppl_side import TheirMockLM, mock_lm

import smcsd_ppl.llamppl as ours
from smcsd_ppl.inference import steer


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # LLaMPPL divides 0 by a 0 weight
def test_keep_chooses_as_llamppl_does():
    """The without-replacement resampling picks LLaMPPL's children and c, given the same uniform."""
    rng = np.random.default_rng(0)
    for case in range(400):
        m, n = int(rng.integers(1, 12)), int(rng.integers(1, 6))
        w = rng.exponential(size=m) ** 3
        w[rng.random(m) < 0.2] = 0.0 if case % 3 else w[0]  # dead children and ties
        if w.sum() == 0:
            continue
        p = w / w.sum()
        np.random.seed(case)
        sure, drawn, c = resample_optimal(p, n)
        np.random.seed(case)
        mine = steer.keep(p, n, np.random.random_sample)
        assert mine[0].tolist() == sure.tolist() and mine[1].tolist() == drawn.tolist(), (p, n)
        assert mine[2] == pytest.approx(c)


def program(Model, LMContext):
    """One program for both libraries: a token drawn with numpy, observed from the LM."""

    class Pick(Model):
        def __init__(self, lm, length):
            super().__init__()
            self.context = LMContext(lm, [0, 1])
            self.length = length

        async def step(self):
            token = await self.sample(llamppl.LogCategorical(np.log([0.5, 0.3, 0.2])))
            await self.observe(self.context.next_token(), int(token))
            if int(token) == 2 or self.context.token_count >= self.length:
                self.finish()

    return Pick


def generated(ctx) -> list[int]:
    return [int(t) for t in ctx.tokens[2:]]


@pytest.mark.parametrize("n, k", [(3, 2), (4, 3), (1, 4), (5, 2)])
def test_smc_steer_matches_llamppl_output_for_output(n, k, monkeypatch):
    # Every random draw comes from numpy's global stream in both runs: the programs' tokens
    # (in particle order) and the stratified pass's uniform; the LM weights are the mock's.
    lm = mock_lm()
    theirs_lm = TheirMockLM(lm.pair.target_lm)
    monkeypatch.setattr(steer, "_uniform", lambda g: np.random.random_sample())
    for seed in range(6):
        np.random.seed(seed)
        mine = asyncio.run(ours.smc_steer(program(ours.Model, ours.LMContext)(lm, 5), n, k))
        np.random.seed(seed)
        Theirs = program(llamppl.Model, llamppl.LMContext)
        theirs = asyncio.run(llamppl.smc_steer(Theirs(theirs_lm, 5), n, k))
        assert [generated(p.context) for p in mine] == [generated(p.context) for p in theirs]
        assert [p.weight for p in mine] == pytest.approx([p.weight for p in theirs], abs=1e-4)
        assert len(mine) == n and all(p.finished for p in mine)


def test_one_child_each_keeps_every_particle_with_its_own_weight():
    # With K = 1 every child sits at LLaMPPL's threshold (c w = 1 in exact arithmetic), where its
    # rounding decides whether a uniform is drawn, so the streams cannot be compared; what the
    # algorithm means there is plain importance sampling: all N kept, each with its own weight.
    lm = mock_lm()
    target = lm.pair.target_lm
    np.random.seed(0)
    particles = asyncio.run(ours.smc_steer(program(ours.Model, ours.LMContext)(lm, 5), 4, 1))
    assert len(particles) == 4
    for p in particles:
        ids = [0, 1] + p.context.generated
        exact = sum(float(target.next_logits(ids[:j]).log_softmax(-1)[ids[j]]) for j in range(2, len(ids)))
        assert p.weight == pytest.approx(exact, abs=1e-4)


def test_smc_steer_steps_blocks_and_keeps_n_particles():
    """A program of SMC-SD blocks runs under smc_steer; N particles come back, finished."""

    class Blocks(ours.Model):
        def __init__(self, lm):
            super().__init__()
            self.context = ours.LMContext(lm, [0, 1])

    particles = asyncio.run(ours.smc_steer(Blocks(mock_lm()), 3, 2, max_new_tokens=6, block_size=2))
    assert len(particles) == 3 and all(p.finished for p in particles)
    for p in particles:
        ids = p.context.generated
        assert 0 < len(ids) <= 6 and EOS not in ids[:-1]
    assert all(np.isfinite(p.weight) for p in particles)


def test_smc_steer_refuses_a_zero_beam():
    with pytest.raises(ValueError, match="n_beam >= 1"):
        asyncio.run(ours.smc_steer(program(ours.Model, ours.LMContext)(mock_lm(), 3), 2, 0))


def test_every_round_of_children_shares_one_target_forward():
    lm = mock_lm()
    stats = lm.pair.target_lm.stats
    stats.reset()
    np.random.seed(0)
    particles = asyncio.run(ours.smc_steer(program(ours.Model, ours.LMContext)(lm, 5), 3, 2))
    rounds = max(p.context.token_count for p in particles)
    assert stats.calls <= 1 + rounds  # the prefill, then at most one forward per round (6 children each)

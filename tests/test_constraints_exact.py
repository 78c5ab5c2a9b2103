"""Constraints and twists keep SMC-SD properly weighted: exact enumeration on the mock LM."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    EOS,
    DeadEnd,
    Forced,
    NoOneZero,
    Nothing,
    Twisted,
    V,
    exact_target,
    mock_pair,
    satisfies,
    smc,
    total_variation,
)

import smcsd_ppl.inference.cycle as cycle_module
import smcsd_ppl.inference.drafting as drafting_module
from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.config import DraftRecord
from smcsd_ppl.inference.blocks import BlockRequest, RowConstraint
from smcsd_ppl.inference.drafting import draft_blocks, generator_draws
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.rows import RowStore

H, PROMPT = 4, [1, 2]
# Runs and distance bound: a correct sampler's Z-weighted estimate lies ~0.04-0.06 (TV)
# from the target at these run counts (measured over seeds; it halves with 4x the runs,
# as noise does). The critic kills particles, so it needs more runs for the same noise.
RUNS = {"proposal": 4000, "critic": 12000}
TV_LIMIT = 0.07


def constrained_target(target):
    weights, _ = exact_target(target, PROMPT, H)
    kept = {y: w for y, w in weights.items() if satisfies(y)}
    return kept, sum(kept.values())


class Constrained(SMCSDModel):
    async def step(self):
        await self.extend()


def run(program, mode, runs, seed, **cfg):
    target, draft = mock_pair()
    programs = [program(PROMPT, NoOneZero(), mode) for _ in range(runs)]
    return target, smc(target, draft, programs, max_new_tokens=H, draft_temperature=1.0, seed=seed, **cfg)


def z_weighted(results):
    est, total = {}, 0.0
    for r in results:
        zr = math.exp(r.smc.log_z)
        if zr == 0:  # every particle died: contributes nothing
            continue
        w = torch.softmax(torch.tensor([p.log_weight for p in r.smc.particles], dtype=torch.float64), 0)
        for p, wi in zip(r.smc.particles, w.tolist()):
            est[tuple(p.token_ids)] = est.get(tuple(p.token_ids), 0.0) + zr * wi
        total += zr
    return {k: v / total for k, v in est.items()}


@pytest.mark.parametrize("mode", ["proposal", pytest.param("critic", marks=pytest.mark.slow)])
@pytest.mark.parametrize("program", [Constrained, pytest.param(Twisted, marks=pytest.mark.slow)])
def test_constrained_smcsd_is_properly_weighted(mode, program):
    # K = 1: particles live for two or more cycles within the horizon, so twists act.
    Twisted.twists = 0
    k = 1 if program is Twisted else 2
    target, results = run(program, mode, RUNS[mode], seed=11, n_particles=3, block_size=k, ess_threshold=0.7)
    assert program is not Twisted or Twisted.twists > RUNS[mode] // 4  # the twist acted, often
    exact, z = constrained_target(target)
    assert 0.05 < z < 0.95  # the constraint matters
    for r in results:  # every weighted particle satisfies the constraint
        for p in r.smc.particles:
            assert p.log_weight == -math.inf or satisfies(p.token_ids), p.token_ids
        assert satisfies(r.token_ids)
    zs = torch.tensor([math.exp(r.smc.log_z) for r in results], dtype=torch.float64)
    stderr = float(zs.std() / math.sqrt(len(zs)))
    assert abs(float(zs.mean()) - z) < 4 * stderr, (float(zs.mean()), z, stderr)
    assert total_variation(z_weighted(results), {k: v / z for k, v in exact.items()}) < TV_LIMIT


@pytest.mark.slow
def test_the_check_fails_if_critic_cuts_resume(monkeypatch):
    # A particle resuming after a cut reaches outputs through several segmentations:
    # the same checks must catch the resulting bias.
    real = cycle_module.draft_blocks

    def resume(*args, **kwargs):
        blocks = real(*args, **kwargs)
        for b in blocks:  # the block still ends where the constraint found nothing, but lives on
            if b.dead_at is not None:
                b.reach, b.dead_at = min(b.reach, b.dead_at), None
        return blocks

    monkeypatch.setattr(cycle_module, "draft_blocks", resume)
    target, results = run(
        Constrained, "critic", 4000, seed=11, n_particles=3, block_size=2, ess_threshold=0.7
    )
    exact, z = constrained_target(target)
    zs = torch.tensor([math.exp(r.smc.log_z) for r in results], dtype=torch.float64)
    stderr = float(zs.std() / math.sqrt(len(zs)))
    biased = abs(float(zs.mean()) - z) > 4 * stderr
    far = total_variation(z_weighted(results), {k: v / z for k, v in exact.items()}) > TV_LIMIT
    assert biased or far


def test_constraint_without_any_first_token_raises():
    target, draft = mock_pair()
    with pytest.raises(ValueError, match="no output can satisfy"):
        smc(target, draft, [Constrained(PROMPT, Nothing())], max_new_tokens=H)


@pytest.mark.parametrize("mode", ["proposal", "critic"])
def test_constraint_no_particle_can_finish_ends_with_a_message(mode):
    target, draft = mock_pair()
    [result] = smc(
        target, draft, [Constrained(PROMPT, DeadEnd(), mode)], max_new_tokens=H, n_particles=4, block_size=2
    )
    assert result.token_ids == [] and result.smc.chosen == -1
    assert ("dead end" if mode == "proposal" else "critic mode") in result.message


def assert_follows_forced(target, results, horizon=5):
    """Z's mean and the Z-weighted outputs against the exact target under ``Forced``."""
    weights, _ = exact_target(target, PROMPT, horizon)
    exact = {y: w for y, w in weights.items() if y[1:3] == (2, 1)[: len(y) - 1]}
    z = sum(exact.values())
    zs = torch.tensor([math.exp(r.smc.log_z) for r in results], dtype=torch.float64)
    stderr = float(zs.std() / math.sqrt(len(zs)))
    assert abs(float(zs.mean()) - z) < 4 * stderr, (float(zs.mean()), z, stderr)
    assert total_variation(z_weighted(results), {k: v / z for k, v in exact.items()}) < TV_LIMIT


@pytest.mark.slow
def test_forced_tokens_skip_draft_forwards_and_stay_properly_weighted():
    # K=2: the first block is all forced (no draft forward; x0 stays unread), the second
    # block (budget 1) then feeds x0, 2, 1 and the bonus in one forward.
    target, draft = mock_pair()
    programs = [Constrained(PROMPT, Forced()) for _ in range(4000)]
    results = smc(
        target, draft, programs, max_new_tokens=5, draft_temperature=1.0, seed=5, n_particles=3, block_size=2
    )
    assert draft.stats.calls == 1 + 1  # prefill, then one forward in the second block
    assert_follows_forced(target, results)


@pytest.mark.slow
def test_requests_decoding_alone_take_forced_tokens_without_a_forward_and_stay_exact(monkeypatch):
    # A record that says the draft never pays: every particle decodes with the target alone.
    # After the first token the constraint forces 2 then 1: the target reads them with the
    # token before them, so the first cycle's one forward already draws the fourth token.
    # A loose cut: the point mass must keep it exact alone (the default cut refuses most
    # wrong guesses, and would hide one).
    def alone(n, *, forcing=True):
        if not forcing:
            monkeypatch.setattr(drafting_module, "forces", lambda request, store: False)
        target, draft = mock_pair(rare_eos=True)  # most outputs reach the free tokens after 2, 1
        programs = [Constrained(PROMPT, Forced()) for _ in range(n)]
        settings = dict(n_particles=3, block_size=2, cut=0.9, proposal="draft")
        results = smc(
            target, draft, programs, max_new_tokens=5, seed=5, record=DraftRecord(0.0, 50.0), **settings
        )
        assert draft.stats.calls == 0 and not any(any(r.smc.draft_lengths) for r in results)
        return target, results

    target, results = alone(4000)
    assert_follows_forced(target, results)
    # One run: the prefill and a forward per cycle, two forwards fewer than token by token.
    forcing, _ = alone(1)
    plain, _ = alone(1, forcing=False)
    assert forcing.stats.calls == plain.stats.calls - 2, (forcing.stats.calls, plain.stats.calls)


def test_a_row_decoding_alone_beside_drafting_rows_takes_its_forced_tokens_as_a_point_mass():
    # Row 0 drafts under NoOneZero (a choice at every step: draft forwards run); row 1 decodes
    # alone and its constraint forces 2 then 1: q is a point mass there, whatever the draft says.
    target, draft = mock_pair()
    store = RowStore(target, draft)
    store.start([PROMPT], [0, 0])
    store.queue({0: [2], 1: [0]})
    requests = [
        BlockRequest(0, 10, RowConstraint(NoOneZero(), "proposal", (2,)), limit=2),
        BlockRequest(1, 10, RowConstraint(Forced(), "proposal", (0,)), limit=0),
    ]
    draws = generator_draws(torch.Generator().manual_seed(1), 2, store.device)
    before = draft.stats.calls
    drafting, alone = draft_blocks(
        store, requests, block_size=2, temperature=1.0, eos={EOS}, draws=draws, keep_probs=True
    )
    assert draft.stats.calls == before + 2  # row 0's two draft forwards
    assert alone.tokens == [2, 1] and alone.limit == 2 and alone.fed == 0
    assert alone.draft_logq.tolist() == [0.0, 0.0]
    assert alone.draft_probs[[0, 1], [2, 1]].tolist() == [1.0, 1.0] and float(alone.draft_probs.sum()) == 2.0
    for j in range(2):  # the drafting row's q is the draft's, masked, on its own context
        context = [2, *drafting.tokens[:j]]
        q = torch.softmax(draft.next_logits(PROMPT + context), -1) * NoOneZero().next_mask([context])[0]
        assert float(drafting.draft_logq[j]) == pytest.approx(
            math.log(q[drafting.tokens[j]] / q.sum()), abs=1e-5
        )


def test_drafted_log_q_is_the_drafts_on_the_true_context(monkeypatch):
    """Tokens of skipped forwards are fed later: every log q is the draft's given the true context."""
    seen, real = [], cycle_module.draft_blocks

    def spy(*args, **kwargs):
        blocks = real(*args, **kwargs)
        seen.extend(blocks)
        return blocks

    monkeypatch.setattr(cycle_module, "draft_blocks", spy)
    target, _ = mock_pair()
    draft = MockLM(V, order=6, seed=3)  # sees far back: a token fed twice or never shows
    t_d, forced = 0.8, Forced()
    programs = [Constrained(PROMPT, forced) for _ in range(40)]
    smc(
        target, draft, programs, max_new_tokens=12, draft_temperature=t_d, seed=2, n_particles=4, block_size=2
    )
    checked = 0
    for b in seen:
        for j in range(b.limit):
            context = list(b.constraint.context) + b.tokens[:j]
            mask = forced.next_mask([context])[0]
            q = torch.softmax(draft.next_logits(PROMPT + context) / t_d, -1) * mask
            expected = 0.0 if mask.sum() == 1 else math.log(q[b.tokens[j]] / q.sum())
            assert float(b.draft_logq[j]) == pytest.approx(expected, abs=1e-5), (b.row, j, context)
            checked += mask.sum() > 1
    assert checked > 50

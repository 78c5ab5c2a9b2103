"""The outputs SMC-SD returns follow the target: exact enumeration of their token marginals.

Z-pooled checks (``test_exact``, ``test_cut_exact``) are right for any population, so they
cannot see how the population was reshaped; these look at what ``generate`` hands back.
Each case runs N = 32 particles, where SMC's own bias is small, and a control with one
particle (the output is then a draft sample) shows that the same check fails when it should.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import EOS, V, distribution_marginal_tv, exact_target, marginal_tv, mock_pair, smc

from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.config import DraftRecord
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.potentials import Constraint

PROMPT, H, RUNS = [1, 2], 4, 2000
TV_LIMIT = 0.05  # the marginals' sampling noise at RUNS is ~0.015


def report(case: str, tv: float) -> float:
    print(f"{case}: largest marginal TV {tv:.3f}")  # shown with pytest -s (docs/benchmarks.md)
    return tv


def returned(target, draft, program, **cfg) -> list[list[int]]:
    base = dict(block_size=2, max_new_tokens=H, draft_temperature=1.0, seed=3)
    return [r.token_ids for r in smc(target, draft, [program() for _ in range(RUNS)], **(base | cfg))]


def mixture_draft(target: MockLM, share: float = 0.25) -> MockLM:
    """q = (1 - share) p + share delta_0: within the default cut (TV <= share), yet not p."""
    q = (1 - share) * torch.softmax(target.table, -1) + share * torch.nn.functional.one_hot(
        torch.tensor(0), V
    )
    return MockLM(table=q.log())


@pytest.mark.parametrize("n", [pytest.param(32, marks=pytest.mark.slow), 1])
def test_a_fresh_pair_with_the_default_cut_returns_target_outputs(n):
    # The first request of a fresh pair probes the draft; its kept tokens must be weighted too.
    target, _ = mock_pair()
    exact, _ = exact_target(target, PROMPT, H)
    outs = returned(
        target, mixture_draft(target), lambda: SMCSDModel(PROMPT), n_particles=n, block_size=4, cut=0.3
    )
    tv = report(f"(a) fresh pair, cut 0.3, N={n}", marginal_tv(outs, exact, H))
    assert tv < TV_LIMIT if n > 1 else tv > 2 * TV_LIMIT, tv


@pytest.mark.parametrize("cut", [None, 0.3])
@pytest.mark.parametrize("n", [pytest.param(32, marks=pytest.mark.slow), 1])
def test_a_power_target_returns_power_outputs(cut, n):
    # alpha = 2: the global p^2, first token included (each particle draws its own).
    target, draft = mock_pair()
    exact, _ = exact_target(target, PROMPT, H, alpha=2.0)
    outs = returned(target, draft, lambda: SMCSDModel(PROMPT), n_particles=n, alpha=2.0, cut=cut)
    tv = report(f"(b) alpha=2, cut {cut}, N={n}", marginal_tv(outs, exact, H))
    assert tv < TV_LIMIT if n > 1 else tv > 2 * TV_LIMIT, tv


@pytest.mark.parametrize("n", [pytest.param(32, marks=pytest.mark.slow), 1])
def test_a_power_target_decoding_alone_returns_power_outputs(n):
    # A record that says the draft does not pay: every cycle is the target alone. At alpha != 1
    # that is the local power token by token, which only weighted particles turn into p^alpha.
    target, draft = mock_pair()
    exact, _ = exact_target(target, PROMPT, H, alpha=2.0)
    outs = returned(
        target,
        draft,
        lambda: SMCSDModel(PROMPT),
        n_particles=n,
        alpha=2.0,
        cut=0.3,
        record=DraftRecord(0, 50),
    )
    tv = report(f"(b) alpha=2, decoding alone, N={n}", marginal_tv(outs, exact, H))
    assert tv < TV_LIMIT if n > 1 else tv > 2 * TV_LIMIT, tv


class NoZero(Constraint):
    """Never token 0."""

    def next_mask(self, contexts):
        mask = torch.ones(len(contexts), V, dtype=torch.bool)
        mask[:, 0] = False
        return mask


@pytest.mark.slow
@pytest.mark.parametrize("cut", [None, 0.3])
def test_a_proposal_constraint_where_the_draft_underflows_returns_target_outputs(cut):
    # After a 1 the draft puts all its mass on 0, which the constraint forbids: q restricted to
    # the allowed tokens is 0/0. The target has mass there, so no particle may die of it.
    target, draft = mock_pair(noise=0.3)
    draft.table[:, 1, :] = -200.0  # exp(-200) underflows to 0 in float32
    draft.table[:, 1, 0] = 0.0
    weights, _ = exact_target(target, PROMPT, H)
    exact = {y: w for y, w in weights.items() if 0 not in y}
    outs = returned(target, draft, lambda: SMCSDModel(PROMPT, NoZero()), n_particles=32, cut=cut)
    assert all(outs) and not any(0 in o for o in outs)
    assert any(1 in o[:-1] for o in outs)  # the underflowing context was visited
    tv = report(f"(c) proposal constraint, draft underflows, cut {cut}, N=32", marginal_tv(outs, exact, H))
    assert tv < TV_LIMIT


def test_the_control_draft_is_far_enough_from_the_target():
    # Without the constraint's underflow fix the case above loses every output through a 1.
    target, _ = mock_pair(noise=0.3)
    weights, _ = exact_target(target, PROMPT, H)
    through_one = sum(w for y, w in weights.items() if 0 not in y and 1 in y[:-1]) / sum(
        w for y, w in weights.items() if 0 not in y
    )
    assert through_one > 0.2


def test_outputs_do_not_leak_eos():
    target, draft = mock_pair()
    outs = returned(target, draft, lambda: SMCSDModel(PROMPT), n_particles=4)
    assert all(EOS not in o[:-1] and len(o) <= H for o in outs)


class PreferTwos(Constraint):
    """A soft potential: every token is allowed, a 2 weighs e^BONUS (the target becomes p(y) e^(BONUS #2))."""

    weighted = True
    BONUS = 0.7

    def next_mask(self, contexts):
        return torch.ones(len(contexts), V, dtype=torch.bool)

    def next_log_weights(self, contexts):
        out = torch.zeros(len(contexts), V)
        out[:, 2] = self.BONUS
        return out


@pytest.mark.slow
def test_a_soft_potential_weighs_the_outputs():
    target, draft = mock_pair()
    weights, _ = exact_target(target, PROMPT, H)
    tilted = {y: w * math.exp(PreferTwos.BONUS * y.count(2)) for y, w in weights.items()}
    outs = returned(target, draft, lambda: SMCSDModel(PROMPT, PreferTwos()), n_particles=32, cut=0.3)
    tv = report("soft potential, cut 0.3, N=32", marginal_tv(outs, tilted, H))
    assert tv < TV_LIMIT
    assert marginal_tv(outs, weights, H) > 2 * TV_LIMIT  # the weights did move the outputs


def test_a_soft_potential_is_properly_weighted_in_the_papers_algorithm():
    # Whole blocks drafted without the potential: the outputs' own bias at N = 32 is larger
    # (about 0.05), but Z-pooled particles are right for any N.
    target, draft = mock_pair()
    weights, _ = exact_target(target, PROMPT, H)
    tilted = {y: w * math.exp(PreferTwos.BONUS * y.count(2)) for y, w in weights.items()}
    z = sum(tilted.values())
    programs = [SMCSDModel(PROMPT, PreferTwos()) for _ in range(RUNS)]
    results = smc(
        target, draft, programs, block_size=2, max_new_tokens=H, draft_temperature=1.0, seed=3, n_particles=8
    )
    zs = torch.tensor([math.exp(r.smc.log_z) for r in results], dtype=torch.float64)
    assert abs(float(zs.mean()) - z) < 4 * float(zs.std() / math.sqrt(len(zs)))  # unbiased
    pooled: dict = {}
    for r, zr in zip(results, zs.tolist()):
        w = torch.softmax(torch.tensor([p.log_weight for p in r.smc.particles], dtype=torch.float64), 0)
        for p, wi in zip(r.smc.particles, w.tolist()):
            pooled[tuple(p.token_ids)] = pooled.get(tuple(p.token_ids), 0.0) + zr * wi / float(zs.sum())
    assert distribution_marginal_tv(pooled, tilted, H) < TV_LIMIT


@pytest.mark.slow
def test_a_soft_potential_weighs_in_critic_mode_too():
    target, draft = mock_pair()
    weights, _ = exact_target(target, PROMPT, H)
    tilted = {y: w * math.exp(PreferTwos.BONUS * y.count(2)) for y, w in weights.items()}
    outs = returned(
        target, draft, lambda: SMCSDModel(PROMPT, PreferTwos(), "critic"), n_particles=32, cut=0.3
    )
    assert report("soft potential, critic, cut 0.3, N=32", marginal_tv(outs, tilted, H)) < TV_LIMIT


def test_a_genlm_control_potential_keeps_its_finite_weights(tiny_smcsd):
    from genlm.control.potential.base import Potential

    from smcsd_ppl.potentials import PotentialConstraint

    class FewAs(Potential):
        """Every byte string, weighed down by half a nat per letter a."""

        def __init__(self):
            super().__init__(list(range(256)))

        async def prefix(self, context):
            return -0.5 * bytes(context).count(b"a")

        async def complete(self, context):
            return -0.5 * bytes(context).count(b"a")

    soft = PotentialConstraint(FewAs(), tiny_smcsd.tokenizer, tiny_smcsd.eos_token_ids)
    [weights] = soft.next_log_weights([[]])
    a = tiny_smcsd.tokenizer.convert_tokens_to_ids("a")
    assert soft.weighted and weights[a] == pytest.approx(-0.5)
    assert torch.isfinite(weights).sum() > 100  # a soft potential rules nothing out...
    assert weights.max() == 0.0 and int((weights == -0.5).sum()) > 1  # ...it weighs

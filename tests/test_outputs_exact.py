"""The outputs SMC-SD returns follow the target: exact enumeration of their token marginals.

Z-pooled checks (``test_exact``, ``test_cut_exact``) are right for any population, so they
cannot see how the population was reshaped; these look at what ``generate`` hands back.
Each case runs N = 32 particles, where SMC's own bias is small, and a control with one
particle (the output is then a draft sample) shows that the same check fails when it should.
"""

from __future__ import annotations

import pytest
import torch
from helpers import EOS, V, exact_target, marginal_tv, mock_pair, smc

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


@pytest.mark.parametrize("n", [32, 1])
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
@pytest.mark.parametrize("n", [32, 1])
def test_a_power_target_returns_power_outputs(cut, n):
    # alpha = 2: the global p^2, first token included (each particle draws its own).
    target, draft = mock_pair()
    exact, _ = exact_target(target, PROMPT, H, alpha=2.0)
    outs = returned(target, draft, lambda: SMCSDModel(PROMPT), n_particles=n, alpha=2.0, cut=cut)
    tv = report(f"(b) alpha=2, cut {cut}, N={n}", marginal_tv(outs, exact, H))
    assert tv < TV_LIMIT if n > 1 else tv > 2 * TV_LIMIT, tv


@pytest.mark.parametrize("n", [32, 1])
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

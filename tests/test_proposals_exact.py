"""Retrieval, the retrieval-draft mixture, and particles of one request on different proposals:
the outputs ``generate`` returns follow the target (exact enumeration of their token marginals).

As in ``test_outputs_exact``: N = 32 particles, 2000 runs, the largest marginal TV under 0.05;
a control with one particle (the output is then a proposal sample) must fail the same check.
The prompt repeats itself, so retrieval knows continuations from the first block on, and what
the particles write is indexed as they go.

Mutants, each run at N = 32 with the cut on and off (largest marginal TV, limit 0.05):
- the retrieval rows' log q taken as log r (the target's share of the mixture dropped):
  retrieval 0.21 (cut 0.3) / 0.25 (cut off);
- the bonus after a stop for the target weighed as an ordinary bonus (log Z): retrieval
  0.083 / 0.088;
- the mixture's log q taken as the draft's (the mixture weight ignored): mixture 0.13 / 0.19;
- per-particle plans with the retrieval rows' log q taken as log r: 0.093 / 0.12.
"""

from __future__ import annotations

import pytest
import torch
from helpers import exact_target, marginal_tv, mock_pair, smc

from smcsd_ppl.inference import proposing
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.potentials import Constraint

PROMPT, H, RUNS = [1, 2, 0, 1, 2, 2, 0, 1, 2, 0, 1], 4, 2000
TV_LIMIT = 0.05  # the marginals' sampling noise at RUNS is ~0.015


def report(case: str, tv: float) -> float:
    print(f"{case}: largest marginal TV {tv:.3f}")  # shown with pytest -s
    return tv


def returned(program, **cfg) -> list[list[int]]:
    target, draft = mock_pair(rare_eos=True)
    base = dict(block_size=4, max_new_tokens=H, draft_temperature=1.0, seed=3)
    return [r.token_ids for r in smc(target, draft, [program() for _ in range(RUNS)], **(base | cfg))]


def exact():
    target, _ = mock_pair(rare_eos=True)
    return exact_target(target, PROMPT, H)[0]


def check(case: str, outs, n: int, weights=None) -> None:
    tv = report(f"{case}, N={n}", marginal_tv(outs, weights or exact(), H))
    assert tv < TV_LIMIT if n > 1 else tv > 2 * TV_LIMIT, tv


CASES = [(0.3, 32), (None, 32), (0.3, 1)]  # the cut on and off, and the one-particle control


@pytest.mark.parametrize(("cut", "n"), CASES)
@pytest.mark.parametrize("proposal", ["retrieval", "mixture"])
def test_a_retrieval_proposal_returns_target_outputs(proposal, cut, n):
    outs = returned(lambda: SMCSDModel(PROMPT), n_particles=n, cut=cut, proposal=proposal)
    check(f"{proposal}, cut {cut}", outs, n)


class Extend(SMCSDModel):
    """The plain program under another name: it keeps its N particles whatever the schedule says."""

    async def step(self):
        await self.extend()


PLANS = [("draft", 3), ("retrieval", 4), ("mixture", 2), ("target", 0)]


@pytest.mark.parametrize(("cut", "n"), CASES)
def test_particles_of_one_request_on_different_proposals_return_target_outputs(cut, n, monkeypatch):
    # Each particle is weighed by its own proposal: slot i drafts with PLANS[i % 4] every cycle.
    monkeypatch.setattr(proposing, "particle_plan", lambda pop, slot, config: PLANS[slot % len(PLANS)])
    outs = returned(lambda: Extend(PROMPT), n_particles=n, cut=cut, proposal="mixture")
    check(f"per-particle proposals, cut {cut}", outs, n)


def test_auto_probes_both_proposals_side_by_side_and_returns_target_outputs():
    outs = returned(lambda: SMCSDModel(PROMPT), n_particles=32, cut=0.3)
    check("auto, cut 0.3", outs, 32)


class NoTwo(Constraint):
    """Never token 2, which retrieval proposes after (0, 1) and (1, 2) often."""

    def next_mask(self, contexts):
        mask = torch.ones(len(contexts), 4, dtype=torch.bool)
        mask[:, 2] = False
        return mask


def test_masks_apply_to_retrieved_tokens():
    cut = 0.3
    weights = {y: w for y, w in exact().items() if 2 not in y}
    outs = returned(lambda: SMCSDModel(PROMPT, NoTwo()), n_particles=32, cut=cut, proposal="retrieval")
    assert not any(2 in o for o in outs)
    check(f"retrieval under a mask, cut {cut}", outs, 32, weights)

"""Retrieval, the retrieval-draft mixture, and particles of one request on different proposals:
the outputs ``generate`` returns follow the target (exact enumeration of their token marginals).

As in ``test_outputs_exact``: with the cut (blocks cut where D(p || q) > 0.3, or 0.9), the
outputs returned at N = 32 from 2000 runs (4000 for the mixture), largest marginal TV under
0.05; without it (the paper's whole blocks, whose returned outputs carry SMC's own bias at
small N), Z-pooled particles at N = 8, whose mean Z must be unbiased. A control with one
particle (the output is then a proposal sample) fails the returned-output check. The prompt
repeats itself, so retrieval knows continuations from the first block on; what particles
write is indexed too.

Retrieval's tokens are checked by the target (kept with chance min(1, p / r), the bonus after
a refusal from the residual), so its single particle is a target sample: its N = 1 check
passes where the draft's proposals fail it.

Mutants (run by hand, recorded here; largest marginal TV, limit 0.05):
- the mixture's log q taken as the draft's (the mixture weight ignored): 0.095 with the cut
  at 4000 runs (correct: 0.028); without it the mean of Z was 3.9 against 1 (biased);
- the bonus after a refused retrieved token drawn from the target, not the residual: 0.068 for
  one particle without the cut (correct: 0.028), 0.056 pooled (0.011); with the cut the schedule
  retrieves too little for this size to see it (0.028);
- the check's chance taken as p (r ignored): not seen here, where retrieval's r is nearly a
  point mass; ``test_proposals`` checks the check itself (TV 0.36 against 0.003).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import distribution_marginal_tv, exact_target, marginal_tv, mock_pair, smc

from smcsd_ppl.inference import proposing
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.potentials import Constraint

PROMPT, H, RUNS = [1, 2, 0, 1, 2, 2, 0, 1, 2, 0, 1], 4, 2000
TV_LIMIT = 0.05  # the marginals' sampling noise at RUNS is ~0.015


def report(case: str, tv: float) -> float:
    print(f"{case}: largest marginal TV {tv:.3f}")  # shown with pytest -s
    return tv


def run(program, runs=RUNS, **cfg):
    target, draft = mock_pair(rare_eos=True)
    base = dict(block_size=4, max_new_tokens=H, draft_temperature=1.0, seed=3)
    return smc(target, draft, [program() for _ in range(runs)], **(base | cfg))


def exact():
    target, _ = mock_pair(rare_eos=True)
    return exact_target(target, PROMPT, H)


def returned_tv(case: str, results, weights=None) -> float:
    """The largest marginal TV of the outputs ``generate`` returned."""
    return report(case, marginal_tv([r.token_ids for r in results], weights or exact()[0], H))


def pooled_tv(case: str, results) -> float:
    """Z-pooled particles (right for any N): log Z unbiased, and their marginal TV."""
    weights, z = exact()
    zs = torch.tensor([math.exp(r.smc.log_z) for r in results], dtype=torch.float64)
    # Where every weight is exact (retrieval checked by the target), Z-hat is Z itself: only the
    # float32 rounding of the mock's probabilities (~1e-7) is left, which 1e-6 allows.
    se = float(zs.std() / math.sqrt(len(zs)))
    assert abs(float(zs.mean()) - z) < 4 * se + 1e-6 * z, float(zs.mean())
    pooled: dict = {}
    for r, zr in zip(results, zs.tolist()):
        w = torch.softmax(torch.tensor([p.log_weight for p in r.smc.particles], dtype=torch.float64), 0)
        for p, wi in zip(r.smc.particles, w.tolist()):
            pooled[tuple(p.token_ids)] = pooled.get(tuple(p.token_ids), 0.0) + zr * wi / float(zs.sum())
    return report(case, distribution_marginal_tv(pooled, weights, H))


class Extend(SMCSDModel):
    """The plain program under another name: it keeps its N particles whatever the schedule says."""

    async def step(self):
        await self.extend()


PLANS = [("draft", 3), ("retrieval", 4), ("mixture", 2), ("target", 0)]


def runs_of(case: str, monkeypatch, **cfg):
    """Runs of one case: a proposal for every particle, or (``mixed``) each slot its own plan."""
    if case == "mixed":  # slot i drafts with PLANS[i % 4] every cycle
        monkeypatch.setattr(proposing, "particle_plan", lambda pop, slot, config: PLANS[slot % len(PLANS)])
        return run(lambda: Extend(PROMPT), proposal="mixture", **cfg)
    return run(lambda: SMCSDModel(PROMPT), proposal=case, **cfg)


CASES = ["retrieval", "mixture", "mixed"]


# A loose cut (0.9) lets retrieval propose where r and p differ, so its weights matter more.
# The mixture's weights vary most: its returned outputs keep a bias of about 0.02 at N = 32
# (0.023 over 6,000 runs, against 0.01-0.03 for the draft alone), which leaves the least room
# for sampling noise, so it runs twice the runs (noise ~0.01).
@pytest.mark.slow
@pytest.mark.parametrize(("case", "cut"), [(c, 0.3) for c in CASES] + [("retrieval", 0.9)])
def test_returned_outputs_follow_the_target_with_the_cut(case, cut, monkeypatch):
    runs = 2 * RUNS if case == "mixture" else RUNS
    results = runs_of(case, monkeypatch, n_particles=32, cut=cut, runs=runs)
    assert returned_tv(f"{case}, cut {cut}, N=32", results) < TV_LIMIT


# The fast tier checks the mixed case (retrieved and drafted blocks both); the others with --full.
@pytest.mark.parametrize(
    "case", [c if c == "mixed" else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_pooled_particles_follow_the_target_without_the_cut(case, monkeypatch):
    # Whole blocks: the returned outputs' own bias at small N is larger, Z-pooled particles are
    # right for any N (as in test_outputs_exact's paper-mode check).
    assert (
        pooled_tv(f"{case}, cut off, N=8, pooled", runs_of(case, monkeypatch, n_particles=8, cut=None))
        < TV_LIMIT
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixture", "mixed"])
def test_one_particle_returns_proposal_samples_that_fail_the_check(case, monkeypatch):
    assert (
        returned_tv(f"{case}, cut off, N=1", runs_of(case, monkeypatch, n_particles=1, cut=None))
        > 2 * TV_LIMIT
    )


@pytest.mark.parametrize("cut", [None, 0.3])
def test_one_particle_of_retrieval_returns_target_samples(cut, monkeypatch):
    # The target checks every retrieved token, so a single particle is a target sample: the
    # control above, which fails for the draft's proposals, passes here.
    results = runs_of("retrieval", monkeypatch, n_particles=1, cut=cut)
    assert returned_tv(f"retrieval, cut {cut}, N=1", results) < TV_LIMIT


@pytest.mark.slow
def test_auto_probes_both_proposals_side_by_side_and_returns_target_outputs():
    assert (
        returned_tv("auto, cut 0.3, N=32", run(lambda: SMCSDModel(PROMPT), n_particles=32, cut=0.3))
        < TV_LIMIT
    )


class NoTwo(Constraint):
    """Never token 2, which retrieval proposes after (0, 1) and (1, 2) often."""

    def next_mask(self, contexts):
        mask = torch.ones(len(contexts), 4, dtype=torch.bool)
        mask[:, 2] = False
        return mask


@pytest.mark.slow
def test_masks_apply_to_retrieved_tokens():
    weights = {y: w for y, w in exact()[0].items() if 2 not in y}
    results = run(lambda: SMCSDModel(PROMPT, NoTwo()), n_particles=32, cut=0.3, proposal="retrieval")
    assert not any(2 in r.token_ids for r in results)
    assert returned_tv("retrieval under a mask, cut 0.3, N=32", results, weights) < TV_LIMIT

"""Grammar-conditional exactness: SMC-SD's returned outputs against locally masked decoding.

Exact enumeration on the mock LM (``smcsd_ppl.bench.grammar_exact``): the target x the
language of balanced brackets, and the local projection that AR or speculative decoding
under the mask samples. SMC-SD's outputs must land well below the local projection's
distance at moderate N; one particle and the engine's own AR under the mask, run through
the same check, must fail it.
"""

from __future__ import annotations

import pytest
from helpers import exact_target

from smcsd_ppl.bench import grammar_exact as ge

# TV at these run counts: sampling noise ~0.03-0.05; the local projection sits at 0.95.
MARGIN = 0.2


@pytest.fixture(scope="module")
def case():
    target, draft = ge.dyck_pair(0)
    exact, local, z = ge.exact_distributions(target, ge.BalancedBrackets())
    return target, draft, exact, local, z


def balanced(seq) -> bool:
    """The language, written independently of the constraint's masks."""
    body, depth = list(seq[:-1]), 0
    for t in body:
        depth += 1 if t == ge.OPEN else -1 if t == ge.CLOSE else -99
        if depth < 0:
            return False
    return seq[-1] == ge.EOS and depth == 0 and 0 < len(body) <= ge.MAX_LENGTH


def test_the_case_is_exact_and_locally_masked_decoding_is_far_from_it(case):
    target, _, exact, local, z = case
    weights, _ = exact_target(target, ge.PROMPT, ge.HORIZON)  # brute force over every sequence
    valid = {y: w for y, w in weights.items() if balanced(y)}
    assert sum(valid.values()) == pytest.approx(z, rel=1e-6)  # float32 there, float64 here
    assert ge.total_variation({y: w / z for y, w in valid.items()}, exact) < 1e-6
    assert sum(local.values()) == pytest.approx(1.0) and set(local) == set(exact)
    assert ge.total_variation(exact, local) > 0.9


def outputs(case, n, mode="proposal", runs=1000, **kw):
    target, draft, exact, local, _ = case
    got = ge.returned_outputs(target, draft, n=n, mode=mode, runs=runs, seed=11, **kw)
    return ge.total_variation(exact, got), ge.total_variation(exact, local), got


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "n", "runs"), [("proposal", 16, 1000), ("critic", 64, 600)])
def test_smcsd_returns_outputs_closer_to_target_x_constraint_than_local_masking(case, mode, n, runs):
    tv, local_tv, _ = outputs(case, n, mode, runs, cut=None)
    assert tv < local_tv - MARGIN, (tv, local_tv)


@pytest.mark.slow
def test_the_check_fails_for_one_particle_and_for_ar_under_the_mask(case):
    tv, local_tv, _ = outputs(case, 1, cut=None)
    assert not tv < local_tv - MARGIN, (tv, local_tv)
    tv, local_tv, got = outputs(case, 1, alone=True, cut=0.3)  # the target alone, under the mask
    assert not tv < local_tv - MARGIN, (tv, local_tv)
    assert ge.total_variation(case[3], got) < 0.08  # it samples the local projection itself

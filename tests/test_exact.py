"""Exactness and proper weighting, checked by exact enumeration on a 4-token vocabulary."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers import EOS, chi_square_pvalue, exact_target, mock_pair, sd, smc, total_variation

from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.methods.ar import autoregressive

PROMPT = [1, 2]
H = 4


@pytest.mark.parametrize("t_t", [1.0, 0.6])
def test_speculative_sampling_reproduces_the_target(t_t):
    target, draft = mock_pair()
    out = sd(
        target,
        draft,
        [PROMPT] * 3000,
        block_size=2,
        max_new_tokens=H,
        draft_temperature=0.8,
        seed=1,
        target_temperature=t_t,
    )
    exact, z = exact_target(target, PROMPT, H, temperature=t_t)
    assert sum(out.accepted) < sum(out.drafted)  # the draft differs: rejections happened
    assert chi_square_pvalue(Counter(map(tuple, out.token_ids)), {k: v / z for k, v in exact.items()}) > 1e-3


def test_speculative_sampling_check_can_fail():
    # Sampling from the draft alone must be rejected by the same statistical check.
    target, draft = mock_pair()
    out = autoregressive(
        draft,
        [PROMPT] * 3000,
        eos_token_ids=[EOS],
        max_new_tokens=H,
        temperature=1.0,
        g=torch.Generator().manual_seed(0),
    )
    exact, _ = exact_target(target, PROMPT, H)
    assert chi_square_pvalue(Counter(map(tuple, out)), exact) < 1e-3


def smc_runs(runs, alpha=1.0, draft=None, **cfg):
    target, default_draft = mock_pair()
    cfg.setdefault("draft_temperature", 1.0)
    results = smc(
        target,
        draft or default_draft,
        [SMCSDModel(PROMPT) for _ in range(runs)],
        max_new_tokens=H,
        alpha=alpha,
        **cfg,
    )
    support, _ = exact_target(target, PROMPT, H)
    outside = [p.token_ids for r in results for p in r.smc.particles if tuple(p.token_ids) not in support]
    assert outside == [], f"outputs the target cannot produce (EOS inside, or over budget): {outside[:5]}"
    return target, results


@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_smcsd_log_z_is_unbiased(alpha):
    target, results = smc_runs(1500, alpha=alpha, n_particles=4, block_size=1, ess_threshold=1.0, seed=2)
    _, z = exact_target(target, PROMPT, H, alpha=alpha)
    zs = torch.tensor([math.exp(r.smc.log_z) for r in results], dtype=torch.float64)
    assert sum(r.smc.n_resamples for r in results) > 0
    stderr = float(zs.std() / math.sqrt(len(zs)))
    assert abs(float(zs.mean()) - z) < 4 * stderr + 1e-9, (float(zs.mean()), z, stderr)


def test_smcsd_is_properly_weighted():
    # E[Z_hat * sum_i W_i f(y_i)] = Z * E_target[f] for any N: pool runs by their Z_hat.
    target, results = smc_runs(1500, alpha=2.0, n_particles=3, block_size=1, ess_threshold=0.7, seed=3)
    exact, z = exact_target(target, PROMPT, H, alpha=2.0)
    est: dict = {}
    total = 0.0
    for r in results:
        zr = math.exp(r.smc.log_z)
        w = torch.softmax(torch.tensor([p.log_weight for p in r.smc.particles]), 0)
        for p, wi in zip(r.smc.particles, w.tolist()):
            est[tuple(p.token_ids)] = est.get(tuple(p.token_ids), 0.0) + zr * wi
        total += zr
    est = {k: v / total for k, v in est.items()}
    assert total_variation(est, {k: v / z for k, v in exact.items()}) < 0.06


def weighted_tv(results, exact, z):
    est: dict = {}
    for r in results:
        w = torch.softmax(torch.tensor([p.log_weight for p in r.smc.particles]), 0)
        for p, wi in zip(r.smc.particles, w.tolist()):
            est[tuple(p.token_ids)] = est.get(tuple(p.token_ids), 0.0) + wi / len(results)
    return total_variation(est, {k: v / z for k, v in exact.items()})


@pytest.mark.slow
def test_smcsd_converges_as_particles_grow():
    tvs = []
    for n in (1, 4, 32):
        target, results = smc_runs(1600, n_particles=n, block_size=2, ess_threshold=0.5, seed=4)
        exact, z = exact_target(target, PROMPT, H)
        tvs.append(weighted_tv(results, exact, z))
    assert tvs[0] > tvs[1] > tvs[2], tvs
    assert tvs[2] < 0.05, tvs


def test_smcsd_with_a_perfect_draft_is_the_target():
    target, _ = mock_pair()
    _, results = smc_runs(2000, draft=target, n_particles=2, block_size=2, seed=5)
    exact, _ = exact_target(target, PROMPT, H)
    for r in results:  # q = p: every increment is exactly zero
        assert all(abs(p.log_weight) < 1e-5 for p in r.smc.particles)
        assert abs(r.smc.log_z) < 1e-5
    assert chi_square_pvalue(Counter(tuple(r.token_ids) for r in results), exact) > 1e-3

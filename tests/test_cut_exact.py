"""The quality cut keeps SMC-SD properly weighted: exact enumeration on the mock pair.

Every check pools runs by their Z estimate: E[Z_hat sum_i W_i f(y_i)] = Z E_target[f].
A cut decided from the drawn token itself (instead of the prefix) must fail the same checks.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers import NoOneZero, Twisted, exact_target, mock_pair, satisfies, smc, total_variation

import smcsd_ppl.inference.cycle as cycle_module
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.verification import pick

PROMPTS = ([1, 2], [0, 3, 1, 2, 1])  # different lengths, one batch
TV_LIMIT = 0.07


def pooled(results):
    """Z-weighted output distribution and the Z estimates of each run."""
    est, total, zs = {}, 0.0, []
    for r in results:
        zr = math.exp(r.smc.log_z)
        zs.append(zr)
        if zr == 0:
            continue
        w = torch.softmax(torch.tensor([p.log_weight for p in r.smc.particles], dtype=torch.float64), 0)
        for p, wi in zip(r.smc.particles, w.tolist()):
            est[tuple(p.token_ids)] = est.get(tuple(p.token_ids), 0.0) + zr * wi
        total += zr
    return {k: v / total for k, v in est.items()}, torch.tensor(zs, dtype=torch.float64)


def check(results, exact, z):
    """Whether Z_hat is unbiased (4 s.e.) and the Z-weighted outputs match the target (TV)."""
    est, zs = pooled(results)
    stderr = float(zs.std() / math.sqrt(len(zs)))
    unbiased = abs(float(zs.mean()) - z) < 4 * stderr
    tv = total_variation(est, {k: v / z for k, v in exact.items()})
    return unbiased, tv, (float(zs.mean()), z, stderr)


CASES = {
    "t_t=0.8": dict(program="plain", horizon=5, target_temperature=0.8, rare_eos=False),
    "alpha=2, rare EOS": dict(program="plain", horizon=5, alpha=2.0, rare_eos=True),
    "constraint": dict(program="constraint", horizon=5, rare_eos=False),
    "twist": dict(program="twist", horizon=5, rare_eos=False),
    "critic": dict(program="critic", horizon=5, rare_eos=False),
    "paper, t_t=0.8": dict(program="plain", horizon=5, target_temperature=0.8, rare_eos=False, cut=None),
}
RUNS = {"critic": 8000}  # the critic kills particles: more runs for the same noise


def run_case(case, runs, seed=11):
    spec = dict(CASES[case])
    program, horizon, rare = spec.pop("program"), spec.pop("horizon"), spec.pop("rare_eos")
    target, draft = mock_pair(rare_eos=rare)
    cfg = dict(n_particles=3, block_size=2, ess_threshold=0.7, draft_temperature=1.0, cut=0.25) | spec
    make = {
        "plain": lambda prompt: SMCSDModel(prompt),
        "constraint": lambda prompt: SMCSDModel(prompt, NoOneZero()),
        "twist": lambda prompt: Twisted(prompt, NoOneZero()),
        "critic": lambda prompt: SMCSDModel(prompt, NoOneZero(), "critic"),
    }[program]
    programs = [make(PROMPTS[i % 2]) for i in range(2 * runs)]
    results = smc(target, draft, programs, max_new_tokens=horizon, seed=seed, **cfg)
    groups = []
    for i, prompt in enumerate(PROMPTS):
        exact, _ = exact_target(
            target,
            prompt,
            horizon,
            temperature=cfg.get("target_temperature", 1.0),
            alpha=cfg.get("alpha", 1.0),
        )
        if program != "plain":
            exact = {y: w for y, w in exact.items() if satisfies(y)}
        groups.append((results[i::2], exact, sum(exact.values())))
    return cfg, groups


# The fast tier weighs the plain cut; the other cases (a minute each on 2 cores) run with --full.
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[] if c == "t_t=0.8" else pytest.mark.slow) for c in CASES]
)
def test_cut_smcsd_is_properly_weighted(case, monkeypatch):
    cuts = []
    real = cycle_module.verify_blocks

    def spy(*args, **kwargs):
        verdict = real(*args, **kwargs)
        cuts.extend(zip(verdict.diverged.tolist(), verdict.kept.tolist()))
        return verdict

    monkeypatch.setattr(cycle_module, "verify_blocks", spy)
    Twisted.twists = 0
    cfg, groups = run_case(case, runs=RUNS.get(case, 3000))
    if cfg["cut"] is not None:  # the cut fires, but not always
        assert any(d for d, _ in cuts) and any(not d and k > 0 for d, k in cuts)
    if case == "twist":
        assert Twisted.twists > 0
    for results, exact, z in groups:
        assert max(len(r.smc.ess_trace) for r in results) >= 2  # several cycles
        unbiased, tv, detail = check(results, exact, z)
        assert unbiased, detail
        assert tv < TV_LIMIT, tv


@pytest.mark.slow
def test_a_cut_that_reads_the_drawn_token_is_not_properly_weighted(monkeypatch):
    """Cutting where the drawn token's p/q is small, then dropping it, biases the output."""
    real = cycle_module.verify_blocks

    def token_cut(logits, batch, g, **kw):
        k, limit = batch.tokens.shape[1], batch.limit
        ratio = pick(torch.log_softmax(logits[:, :k].float(), -1), batch.tokens) - batch.draft_logq  # [R, k]
        low = (ratio < -0.3) & (torch.arange(k)[None, :] < limit[:, None])
        at = torch.where(low.any(1), low.float().argmax(1), limit)
        cut = at < limit
        batch = replace(
            batch, limit=torch.where(cut, at, limit), stops=batch.stops & ~cut, dead=batch.dead & ~cut
        )
        return real(logits, batch, g, **(kw | {"cut": None}))

    monkeypatch.setattr(cycle_module, "verify_blocks", token_cut)
    _, groups = run_case("alpha=2, rare EOS", runs=3000)
    failures = [not unbiased or tv > TV_LIMIT for unbiased, tv, _ in (check(*g) for g in groups)]
    assert any(failures)


def test_the_output_particle_is_chosen_in_proportion_to_its_weight():
    # Chosen with probability W_i, the output's own weight averages E[sum_i W_i^2];
    # a uniform choice would average 1/N, the heaviest particle more than both.
    target, draft = mock_pair()
    programs = [SMCSDModel(PROMPTS[0]) for _ in range(4000)]
    results = smc(
        target, draft, programs, max_new_tokens=4, n_particles=4, block_size=2, ess_threshold=0.0, seed=3
    )
    chosen, expected = [], []
    for r in results:
        w = torch.softmax(torch.tensor([p.log_weight for p in r.smc.particles], dtype=torch.float64), 0)
        chosen.append(float(w[r.smc.chosen]))
        expected.append(float((w * w).sum()))
    chosen, expected = torch.tensor(chosen), torch.tensor(expected)
    stderr = float((chosen - expected).std() / math.sqrt(len(chosen)))
    assert abs(float(chosen.mean() - expected.mean())) < 4 * stderr, (chosen.mean(), expected.mean(), stderr)
    assert float(expected.mean()) - 0.25 > 8 * stderr  # the weights are uneven enough for this to bite

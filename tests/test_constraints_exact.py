"""Constraints and twists keep SMC-SD properly weighted: exact enumeration on the mock LM."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import EOS, engine, exact_target, total_variation

from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.smc import run_smc_sd

V, H, PROMPT = 4, 4, [1, 2]
# Runs and distance bound: a correct sampler's Z-weighted estimate lies ~0.04-0.06 (TV)
# from the target at these run counts (measured over seeds; it halves with 4x the runs,
# as noise does). The critic kills particles, so it needs more runs for the same noise.
RUNS = {"proposal": 4000, "critic": 12000}
TV_LIMIT = 0.07


class NoOneZero:
    """Outputs without the bigram (1, 0); EOS only once a 2 has appeared."""

    def next_mask(self, contexts):
        out = torch.ones(len(contexts), V, dtype=torch.bool)
        for i, c in enumerate(contexts):
            if not satisfies_prefix(c):
                out[i] = False
                continue
            if c and c[-1] == 1:
                out[i, 0] = False
            out[i, EOS] = 2 in c
        return out


def satisfies_prefix(seq) -> bool:
    body = list(seq)
    if EOS in body:
        return False
    return all(not (a == 1 and b == 0) for a, b in zip(body, body[1:]))


def satisfies(seq) -> bool:
    seq = list(seq)
    if seq and seq[-1] == EOS:
        return satisfies_prefix(seq[:-1]) and 2 in seq[:-1]
    return satisfies_prefix(seq)


def models():
    target = MockLM(V, seed=0, scale=1.5)
    noise = torch.randn(target.table.shape, generator=torch.Generator().manual_seed(7))
    return target, MockLM(table=target.table + 0.8 * noise)


def constrained_target(target):
    weights, _ = exact_target(target, PROMPT, H)
    kept = {y: w for y, w in weights.items() if satisfies(y)}
    return kept, sum(kept.values())


class Constrained(SMCSDModel):
    async def step(self):
        await self.extend()


class Twisted(SMCSDModel):
    """Twists towards outputs with many 2s; the final target must not change."""

    async def step(self):
        await self.extend()
        if not self.finished:
            self.twist(0.7 * self.token_ids.count(2) - 0.3)


def run(program, mode, runs, seed, **cfg):
    target, draft = models()
    eng = engine(target, draft, max_new_tokens=H, draft_temperature=1.0, seed=seed, **cfg)
    results = run_smc_sd([program(PROMPT, NoOneZero(), mode) for _ in range(runs)], eng)
    return target, results


def z_weighted(results):
    est, total = {}, 0.0
    for r in results:
        zr = math.exp(r.log_z)
        if zr == 0:  # every particle died: contributes nothing
            continue
        w = torch.softmax(torch.tensor([p.log_weight for p in r.particles], dtype=torch.float64), 0)
        for p, wi in zip(r.particles, w.tolist()):
            est[tuple(p.token_ids)] = est.get(tuple(p.token_ids), 0.0) + zr * wi
        total += zr
    return {k: v / total for k, v in est.items()}


@pytest.mark.parametrize("mode", ["proposal", "critic"])
@pytest.mark.parametrize("program", [Constrained, Twisted])
def test_constrained_smcsd_is_properly_weighted(mode, program):
    target, results = run(program, mode, RUNS[mode], seed=11, n_particles=3, block_size=2, ess_threshold=0.7)
    exact, z = constrained_target(target)
    assert 0.05 < z < 0.95  # the constraint matters
    for r in results:  # every weighted particle satisfies the constraint
        for p in r.particles:
            assert p.log_weight == -math.inf or satisfies(p.token_ids), p.token_ids
        assert satisfies(r.token_ids)
    zs = torch.tensor([math.exp(r.log_z) for r in results], dtype=torch.float64)
    stderr = float(zs.std() / math.sqrt(len(zs)))
    assert abs(float(zs.mean()) - z) < 4 * stderr, (float(zs.mean()), z, stderr)
    assert total_variation(z_weighted(results), {k: v / z for k, v in exact.items()}) < TV_LIMIT


def test_the_check_fails_if_critic_cuts_resume(monkeypatch):
    # A particle resuming after a cut reaches outputs through several segmentations:
    # the same checks must catch the resulting bias.
    import smcsd_ppl.inference.engine as engine_module

    real = engine_module.BlockEngine.draft_blocks

    def resume(self, *args, **kwargs):
        blocks = real(self, *args, **kwargs)
        for b in blocks:
            b.dead = False
        return blocks

    monkeypatch.setattr(engine_module.BlockEngine, "draft_blocks", resume)
    target, results = run(
        Constrained, "critic", 4000, seed=11, n_particles=3, block_size=2, ess_threshold=0.7
    )
    exact, z = constrained_target(target)
    zs = torch.tensor([math.exp(r.log_z) for r in results], dtype=torch.float64)
    stderr = float(zs.std() / math.sqrt(len(zs)))
    biased = abs(float(zs.mean()) - z) > 4 * stderr
    far = total_variation(z_weighted(results), {k: v / z for k, v in exact.items()}) > TV_LIMIT
    assert biased or far


class Nothing:
    def next_mask(self, contexts):
        return torch.zeros(len(contexts), V, dtype=torch.bool)


def test_constraint_without_any_first_token_raises():
    target, draft = models()
    eng = engine(target, draft, max_new_tokens=H)
    with pytest.raises(ValueError, match="no output can satisfy"):
        run_smc_sd([Constrained(PROMPT, Nothing())], eng)


class DeadEnd:
    """Only token 1 may come first; after it nothing is allowed (and EOS never)."""

    def next_mask(self, contexts):
        out = torch.zeros(len(contexts), V, dtype=torch.bool)
        for i, c in enumerate(contexts):
            if len(c) == 0:
                out[i, 1] = True
        return out


@pytest.mark.parametrize("mode", ["proposal", "critic"])
def test_constraint_no_particle_can_finish_ends_with_a_message(mode):
    target, draft = models()
    eng = engine(target, draft, max_new_tokens=H, n_particles=4, block_size=2)
    [result] = run_smc_sd([Constrained(PROMPT, DeadEnd(), mode)], eng)
    assert result.token_ids == [] and result.chosen == -1
    assert "no particle" in result.message

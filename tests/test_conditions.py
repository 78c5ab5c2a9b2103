"""``extend(condition=...)``: a per-token condition weighs blocks rather than throwing them away.

The no-"e" program's shape on the mock (token i's text is "i"): every token must pass a test
of its text. The particles must be properly weighted for the target conditioned on every token
passing (exact enumeration), and the same check must fail when the draft's restricted
proposal is not renormalized (the weight then misses the mass the condition took away).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import EOS, NoOneZero, V, exact_target, marginal_tv, mock_pair, satisfies, smc, total_variation
from test_constraints_exact import z_weighted

from smcsd_ppl.inference import constrained
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.potentials import Constraint
from smcsd_ppl.potentials.conditions import AllOf, Conditions, TokenCondition

H, PROMPT, RUNS, TV_LIMIT = 4, [1, 2], 4000, 0.07  # as test_constraints_exact's proposal mode
TESTED: list[str] = []  # the pieces the condition was applied to (module-level: not captured)


def no_zero(piece: str) -> bool:
    TESTED.append(piece)
    return "0" not in piece


class WithoutZero(SMCSDModel):
    async def step(self):
        await self.extend(condition=lambda piece: no_zero(piece))  # a new lambda at every step


def conditioned_target(target):
    weights, _ = exact_target(target, PROMPT, H)
    kept = {y: w for y, w in weights.items() if 0 not in y}
    return kept, sum(kept.values())


def run_without_zero(runs: int, seed: int):
    target, draft = mock_pair()
    programs = [WithoutZero(PROMPT) for _ in range(runs)]
    results = smc(
        target, draft, programs, max_new_tokens=H, draft_temperature=1.0, seed=seed,
        n_particles=3, block_size=2, ess_threshold=0.7,
    )  # fmt: skip
    return target, results


def weighting_errors(target, results) -> tuple[float, float]:
    """(|mean Z-hat - Z| in standard errors, TV of the Z-weighted outputs from the exact law)."""
    exact, z = conditioned_target(target)
    zs = torch.tensor([math.exp(r.smc.log_z) for r in results], dtype=torch.float64)
    stderr = float(zs.std() / math.sqrt(len(zs)))
    tv = total_variation(z_weighted(results), {k: v / z for k, v in exact.items()})
    return abs(float(zs.mean()) - z) / stderr, tv


def test_a_condition_in_extend_is_properly_weighted():
    TESTED.clear()
    target, results = run_without_zero(RUNS, seed=11)
    _, z = conditioned_target(target)
    assert 0.05 < z < 0.95  # the condition matters
    assert sorted(TESTED) == sorted(str(i) for i in range(V))  # applied once per vocabulary, not per step
    assert all(r.token_ids and 0 not in r.token_ids for r in results)  # no particle died of it
    assert all(0 not in p.token_ids for r in results for p in r.smc.particles)
    z_error, tv = weighting_errors(target, results)
    assert z_error < 4 and tv < TV_LIMIT, (z_error, tv)


def test_the_check_fails_when_the_restricted_draft_is_not_renormalized(monkeypatch):
    def unnormalized(self, q, allowed):  # the mutant: q masked, its missing mass never divided out
        for i, r, _ in self.items:
            if i in allowed:
                q[r] *= allowed[i].to(q.dtype)

    monkeypatch.setattr(constrained.Masking, "restrict", unnormalized)
    target, results = run_without_zero(RUNS, seed=11)
    z_error, tv = weighting_errors(target, results)
    assert z_error > 4 or tv > TV_LIMIT, (z_error, tv)


@pytest.mark.parametrize("n", [pytest.param(32, marks=pytest.mark.slow), 1])
def test_the_outputs_returned_follow_the_conditioned_target(n):
    # What the user gets back, not a Z-pooled estimate: the returned outputs' token marginals
    # against the exact law. One particle returns a draft sample, which the same check must see.
    target, draft = mock_pair()
    exact, _ = conditioned_target(target)
    programs = [WithoutZero(PROMPT) for _ in range(2000)]
    cfg = dict(max_new_tokens=H, draft_temperature=1.0, seed=3, n_particles=n, block_size=2)
    outs = [r.token_ids for r in smc(target, draft, programs, **cfg)]
    tv = marginal_tv(outs, exact, H)
    assert tv < 0.05 if n > 1 else tv > 0.1, tv


class WithoutTwoAndNoOneZero(SMCSDModel):
    async def step(self):
        await self.extend(condition=lambda piece: piece != "1")


def test_a_condition_and_the_programs_constraint_hold_together():
    target, draft = mock_pair()
    programs = [WithoutTwoAndNoOneZero(PROMPT, NoOneZero()) for _ in range(200)]
    results = smc(target, draft, programs, max_new_tokens=H, n_particles=3, block_size=2, seed=2)
    outs = [r.token_ids for r in results if r.token_ids]
    assert len(outs) > 100
    assert all(1 not in o and satisfies(o) for o in outs)


def test_a_token_condition_answers_as_its_masks_do():
    passes = torch.tensor([False, True, True, False])  # EOS (3) always passes
    condition = TokenCondition(passes, [EOS])
    every = [list(s) for n in range(4) for s in itertools.product(range(V), repeat=n)]
    assert condition.allows(every) == Constraint.allows(condition, every)
    assert condition.next_mask([[1, 2], [0], [3]]).tolist() == [
        [False, True, True, True],
        [False, False, False, False],
        [False, False, False, False],
    ]
    assert condition.is_complete([1, 2]) and not condition.is_complete([0])
    both = AllOf(NoOneZero(), condition)
    assert both.next_mask([[2]]).tolist() == [[False, True, True, True]]
    assert both.allows([[2, 1, 3], [1, 3]]) == [True, False]  # NoOneZero: EOS only after a 2


def test_a_lambda_per_step_is_one_condition_and_captured_values_tell_tests_apart():
    conditions = Conditions(lambda: ["a", "b", "ab", "</s>"], [3])
    made = [conditions.constraint(lambda piece, banned=letter: banned not in piece) for letter in "aab"]
    assert made[0] is made[1] and made[0] is not made[2]
    assert made[0].passes.tolist() == [False, True, False, True]
    assert made[2].passes.tolist() == [True, False, False, True]


def test_a_condition_that_raises_or_is_not_a_function_is_one_line():
    conditions = Conditions(lambda: ["a", "b"], [])
    with pytest.raises(ValueError, match=r"^the condition raised ZeroDivisionError on token 0 \('a'\)"):
        conditions.constraint(lambda piece: 1 / 0)
    with pytest.raises(ValueError, match="must be a function of a token's text, got str"):
        conditions.constraint("e")


def test_the_no_e_program_on_a_real_tokenizer(tiny_smcsd):
    from smcsd_ppl import SMCConfig

    class Lipogram(SMCSDModel):
        async def step(self):
            await self.extend(condition=lambda piece: "e" not in piece.lower())

    config = SMCConfig(n_particles=4, block_size=4, max_new_tokens=24, seed=0)
    outs = tiny_smcsd.run([Lipogram("Write about a cat."), Lipogram("Tell me of the sea.")], config)
    assert all(o.token_ids and "e" not in o.text.lower() for o in outs), [o.text for o in outs]

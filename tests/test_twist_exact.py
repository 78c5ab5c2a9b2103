"""Future-validity twists: exact enumeration of what SMC-SD returns under a constraint.

The cases are the mock grammars of ``smcsd_ppl.bench.grammar_exact`` (balanced brackets, and
an automaton with a garden path), where locally masked decoding lands 0.4-0.95 (TV) from the
grammar-conditional law p x phi / Z. With the exact twist (Phi by dynamic programming) the
returned outputs must come within 0.05 of that law at N = 8, and with its 3-step estimate
(``FutureValidity(depth=3)``) below SMC-SD without a twist on every seed, by more than the
sampling noise (``beats_no_twist``). The one-step lookahead at block ends must keep the weights
proper; it is not held to beat SMC-SD without a twist, which it does on some seeds only
(docs/constraints.md).
The mutants (the twist not cancelled at the end; Phi ignored; a lookahead left in the weights)
must fail.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers import run_rows

from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.bench import grammar_exact as ge
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.inference import constrained, structure
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.rows import RowStore
from smcsd_ppl.potentials.twist import FutureValidity, lm_step

# The whole module is slow (about 7 min on 2 cores: 1,000-2,000 seeded requests per case): the fast
# tier keeps the exactness of the untwisted engine, --full (CI) runs these.
pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)
RUNS = 1000  # sampling noise at these runs: 0.010-0.016 TV (``ge.sampling_noise``)
EXACT_BOUND = 0.05  # the bar for the exact twist at N = 8
N = 8
CUT = 0.3  # the library's default quality cut
# Z-pooled particles of 2,000 requests at N = 32: proper weights came 0.005-0.026 from the exact law
# over seeds 5-9, a lookahead twist left in the weights 0.031-0.044 (under the exact twist's bar
# above). At N = 4 Z's heavy tail made both spread over 0.011-0.103: no bound separated them.
POOLED_BOUND = 0.025


def case(grammar: str, seed: int):
    """(target, draft, constraint, the exact conditional law) of a mock grammar."""
    language, pair = ge.GRAMMARS[grammar]
    target, draft = pair(seed)
    constraint = language()
    exact, _, _ = ge.exact_distributions(target, constraint)
    return target, draft, constraint, exact


def tv_returned(grammar: str, seed: int, twist: str | None = None, constraint=None, **cfg) -> float:
    """TV between the exact law and SMC-SD's returned outputs over ``RUNS`` seeded requests."""
    target, draft, language, exact = case(grammar, seed)
    got = ge.returned_outputs(
        target,
        draft,
        n=cfg.pop("n", N),
        mode="proposal",
        runs=RUNS,
        seed=1000 * seed + 11,
        constraint=constraint or language,
        cut=cfg.pop("cut", CUT),
        twist=twist,
        **cfg,
    )
    return ge.total_variation(exact, got)


def twisted(grammar: str, seed: int, cls=FutureValidity, depth: int | None = None) -> FutureValidity:
    """The case's constraint twisted by ``cls`` (the exact Phi, its ``depth``-step estimate, or a mutant)."""
    target, _, language, _ = case(grammar, seed)
    return cls(language, lm_step(target, ge.PROMPT), ge.HORIZON, depth=depth)


class NotCancelled(FutureValidity):
    """Mutant: the EOS does not divide Phi out, so a twist factor is left in the final weight."""

    def log_phi_after(self, context, token):
        return self.log_phi(context) if token in self.eos_token_ids else super().log_phi_after(context, token)


class PhiIgnored(FutureValidity):
    """Mutant: Phi taken as 1 everywhere (the factors vanish: the mask alone)."""

    def log_phi(self, context):
        return 0.0


@pytest.mark.parametrize("grammar", ["dyck", "garden"])
def test_phi_by_dynamic_programming_is_the_chance_of_a_valid_output(grammar):
    target, _, language, _ = case(grammar, 0)
    twist = twisted(grammar, 0)
    _, _, z = ge.exact_distributions(target, language)
    assert math.exp(twist.log_phi(())) == pytest.approx(z, rel=1e-9)  # Phi(empty) = P_p(valid)
    # Along every valid output the factors telescope to 1: the twist cancels at the end.
    exact, _, _ = ge.exact_distributions(target, language)
    for y in exact:
        total = sum(float(twist.next_log_weights([y[:j]])[0, y[j]]) for j in range(len(y)))
        assert total == pytest.approx(0.0, abs=1e-6), y  # the factors are float32, as the engine reads them


def test_phi_counts_only_completions_that_fit_the_budget():
    target, _, language, exact = case("dyck", 0)
    _, _, z = ge.exact_distributions(target, language)
    step = lm_step(target, ge.PROMPT)
    shortest = (ge.OPEN, ge.CLOSE, ge.EOS)  # "()" and its EOS: the one output of 3 tokens
    assert math.exp(FutureValidity(language, step, 3).log_phi(())) == pytest.approx(
        z * exact[shortest], rel=1e-9
    )
    none_fits = FutureValidity(language, step, 2)  # no valid output has 2 tokens
    assert none_fits.log_phi(()) == -math.inf
    assert not torch.isfinite(none_fits.next_log_weights([()])).any()  # nothing may start


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("grammar", ["dyck", "garden"])
def test_the_exact_twist_returns_the_grammar_conditional_law_at_n_8(grammar, seed):
    assert tv_returned(grammar, seed, "future-validity") < EXACT_BOUND


def one_particle(grammar: str, monkeypatch) -> float:
    """TV from the exact law of one particle's outputs: the target its own draft, the structure read whole."""
    monkeypatch.setattr(structure.grow, "__defaults__", (structure.WIDTH, 10_000))
    target, _, language, exact = case(grammar, 0)
    own = MockLM(table=target.table)
    got = ge.returned_outputs(
        target, own, n=1, mode="proposal", runs=RUNS, seed=11, constraint=language, cut=CUT, twist="structure"
    )
    return ge.total_variation(exact, got)


@pytest.mark.parametrize("grammar", ["dyck", "garden"])
def test_one_particle_samples_the_conditional_law_where_the_tilt_is_phi(grammar, monkeypatch):
    # Read whole, the structure's Phi-hat is Phi. Every token (the lead, the drafted ones, the
    # bonus) is then drawn from p(t | z) Phi(z t) / Phi(z): the grammar-conditional law itself,
    # with no resampling.
    assert one_particle(grammar, monkeypatch) < EXACT_BOUND


def test_a_tilt_of_the_lead_alone_does_not(monkeypatch):
    monkeypatch.setattr(structure, "past", lambda tilts, token: {})  # mutant: nothing tilted past the lead
    assert one_particle("dyck", monkeypatch) > EXACT_BOUND


@functools.cache
def control(grammar: str) -> float:
    """The mutants' control: the exact twist built the way they are, on seed 0."""
    return tv_returned(grammar, 0, constraint=twisted(grammar, 0))


# A twist left in the final weight multiplies each output by Phi of its body; on the garden
# path the likely outputs (c, cc) keep nearly the same Phi, so only the brackets show it.
@pytest.mark.parametrize(
    ("grammar", "mutant"), [("dyck", NotCancelled), ("dyck", PhiIgnored), ("garden", PhiIgnored)]
)
def test_the_twists_mutants_fail_the_bound_the_twist_passes(grammar, mutant):
    assert control(grammar) < EXACT_BOUND
    tv = tv_returned(grammar, 0, constraint=twisted(grammar, 0, mutant))
    assert tv > EXACT_BOUND, (mutant.__name__, tv)


@functools.cache
def untwisted(grammar: str, seed: int) -> float:
    """SMC-SD without a twist: the bar an estimated twist must pass."""
    return tv_returned(grammar, seed)


def beats_no_twist(estimate: float, grammar: str, seed: int) -> bool:
    """Whether an estimated twist's TV beats no twist's by more than the sampling noise.

    Both TVs carry the noise of ``RUNS`` draws (``ge.sampling_noise``: 0.010-0.016 here), so a
    plain ``<`` could pass or fail by chance. Where no twist is already within the exact twist's
    bar (dyck seed 2: 0.041), there is nothing to beat: the estimate must stay within it too.
    """
    base = untwisted(grammar, seed)
    if base < EXACT_BOUND:
        return estimate < EXACT_BOUND
    return estimate + ge.sampling_noise(case(grammar, seed)[3], RUNS, seed) < base


# The k-step estimate: Phi read DEPTH tokens ahead at every token. One or two tokens ahead
# make the garden path's seed 2 worse than no twist (its dead end lies further on; with DEPTH = 1
# this test fails there: docs/constraints.md); three, half the budget, beat no twist on every
# seed of both grammars.
DEPTH = 3


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("grammar", ["dyck", "garden"])
def test_the_k_step_estimate_beats_no_twist_at_n_8(grammar, seed):
    estimate = tv_returned(grammar, seed, constraint=twisted(grammar, seed, depth=DEPTH))
    assert beats_no_twist(estimate, grammar, seed), (estimate, untwisted(grammar, seed))


@pytest.mark.parametrize("seed", (*SEEDS, 3, 4, 5))
@pytest.mark.parametrize("grammar", ["dyck", "garden"])
def test_the_structure_estimate_reaches_the_exact_twist_s_bar_at_n_8(grammar, seed):
    # What a real pair can run: the structure after each block's end, read in its bonus's forward,
    # tilting the next block as far as it reaches. With only its first token tilted (a mutant:
    # ``structure.past`` giving nothing), Dyck seeds 0, 1, 3, 4 and 5 stay at 0.27-0.82.
    estimate = tv_returned(grammar, seed, "structure")
    assert estimate < EXACT_BOUND and beats_no_twist(estimate, grammar, seed), (
        estimate,
        untwisted(grammar, seed),
    )


def test_an_estimate_that_ignores_phi_does_not():
    # With Phi = 1 the estimate's factors vanish: the same requests as no twist, the same TV.
    ignored = tv_returned("dyck", 0, constraint=twisted("dyck", 0, PhiIgnored, depth=DEPTH))
    assert ignored == untwisted("dyck", 0)  # the same outputs, so the same TV to the last digit


class Untwisted(SMCSDModel):
    """Mutant: the lookahead's twist scored and never divided out (``score`` for ``twist``)."""

    def twist(self, amt):
        self.score(amt)


def pooled(program, twist: str, runs: int = 2000) -> tuple[float, float, float]:
    """Z-pooled particles of ``runs`` requests on the brackets case, seed 0, paper's algorithm, N = 32.

    Returns (their TV from the exact law, mean Z / P_p(valid), its standard error): right for any
    N when the weights are proper, so a twist left in the weights shows.
    """
    target, draft, language, exact = case("dyck", 0)
    _, _, z = ge.exact_distributions(target, language)
    config = SMCConfig(
        n_particles=32, block_size=2, draft_temperature=1.0, target_temperature=1.0, cut=None,
        max_new_tokens=ge.HORIZON, seed=5, twist=twist,
    )  # fmt: skip
    results = run_rows(
        [program(list(ge.PROMPT), language) for _ in range(runs)], RowStore(target, draft), config, [ge.EOS]
    )
    zs = torch.tensor([math.exp(r.smc.log_z) for r in results], dtype=torch.float64) / z
    est: dict = {}
    for r, zr in zip(results, zs.tolist()):
        w = torch.softmax(torch.tensor([p.log_weight for p in r.smc.particles], dtype=torch.float64), 0)
        for p, wi in zip(r.smc.particles, w.tolist()):
            est[tuple(p.token_ids)] = est.get(tuple(p.token_ids), 0.0) + zr * wi / float(zs.sum())
    return ge.total_variation(exact, est), float(zs.mean()), float(zs.std() / math.sqrt(runs))


@pytest.mark.parametrize("twist", ["future-validity", "structure", "lookahead"])
def test_twisted_weights_stay_proper_and_keep_the_evidence(twist):
    tv, z, se = pooled(SMCSDModel, twist)
    assert tv < POOLED_BOUND and abs(z - 1) < 4 * se + 0.01, (tv, z, se)


def test_a_finite_twist_that_leaves_ends_unread_stays_proper(monkeypatch):
    # With one choice the most a node follows (a wider mask counted free text), the trees open
    # wherever brackets may still open or close: ``finite`` twists only the ends whose rest is
    # forced and leaves the others untwisted, their bonus read by the next verify. The weights
    # stay proper; the same twist left in them (the mutant) is caught.
    monkeypatch.setattr(structure.grow, "__defaults__", (1, structure.NODES))
    monkeypatch.setattr(structure, "WORDS", 1)
    tv, z, se = pooled(SMCSDModel, "finite")
    assert tv < POOLED_BOUND and abs(z - 1) < 4 * se + 0.01, (tv, z, se)
    tv, _, _ = pooled(Untwisted, "finite")
    assert tv > POOLED_BOUND, tv


def test_the_finite_twist_is_the_structure_twist_where_no_tree_opens():
    # Every mask of the brackets is narrow: no tree opens, so the same requests return the same.
    assert tv_returned("dyck", 0, "finite") == tv_returned("dyck", 0, "structure")


def test_a_lookahead_twist_left_in_the_weights_is_caught():
    tv, _, _ = pooled(Untwisted, "lookahead")
    assert tv > POOLED_BOUND, tv


def test_a_tilt_that_enters_the_target_is_caught(monkeypatch):
    # Mutant: the structure's tilt of the drafted tokens and the bonus weighed as the target's.
    factors = constrained.proposal_factors

    def with_tilt(blocks, vocab, device):
        base, tilt = factors(blocks, vocab, device), constrained.proposal_tilts(blocks, vocab, device)
        return base if tilt is None else tilt if base is None else base + tilt

    monkeypatch.setattr(constrained, "proposal_factors", with_tilt)
    tv, _, _ = pooled(SMCSDModel, "structure")
    assert tv > POOLED_BOUND, tv


def test_the_twist_changes_nothing_without_a_constraint():
    # Same outputs, weights and forwards: the twist is off for an unconstrained request.
    target, draft, _, _ = case("dyck", 0)
    out = {}
    for twist in (None, "future-validity", "structure", "lookahead"):
        store = RowStore(target, draft)
        config = SMCConfig(block_size=2, max_new_tokens=6, seed=3, twist=twist)
        results = run_rows([SMCSDModel(list(ge.PROMPT)) for _ in range(20)], store, config, [ge.EOS])
        out[twist] = [(r.token_ids, r.smc.log_z) for r in results], target.stats.calls
        target.stats.calls = 0
    assert out[None] == out["future-validity"] == out["structure"] == out["lookahead"]


def test_the_twist_is_a_body_field_of_the_http_api():
    from smcsd_ppl.serving.errors import APIError
    from smcsd_ppl.serving.protocol import parse_completion

    base = SMCConfig(twist="lookahead")
    assert (
        parse_completion({"prompt": "x", "twist": "future-validity"}, SMCConfig()).config.twist
        == "future-validity"
    )
    assert parse_completion({"prompt": "x", "twist": "off"}, base).config.twist is None
    assert parse_completion({"prompt": "x"}, base).config.twist == "lookahead"
    with pytest.raises(APIError, match="twist must be one of"):
        parse_completion({"prompt": "x", "twist": "h"}, base)


def test_bad_twists_are_refused():
    with pytest.raises(ValueError, match="twist must be one of"):
        SMCConfig(twist="h-transform")
    with pytest.raises(ValueError, match="needs EOS"):
        SMCConfig(twist="lookahead", ignore_eos=True)
    with pytest.raises(ValueError, match="weighted"):
        FutureValidity(twisted("dyck", 0), lm_step(case("dyck", 0)[0], ge.PROMPT), ge.HORIZON)


def test_the_command_line_selects_the_twist():
    from smcsd_ppl.cli import build_parser
    from smcsd_ppl.cli.options import smc_config

    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--twist", "future-validity"])
    assert smc_config(args).twist == "future-validity"
    assert smc_config(parser.parse_args(["generate", "hi"])).twist == "auto"  # each constraint's own
    assert parser.parse_args(["compare-json", "--twist", "lookahead"]).twist == "lookahead"
    assert parser.parse_args(["grammar-exactness", "--twists", "off,lookahead"]).twists == "off,lookahead"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--twist", "h-transform"])


@pytest.mark.parametrize(
    ("flags", "ran"),
    [
        (["--schema", '{"enum": ["a", "b"]}'], "finite"),
        (["--schema", '{"enum": ["a", "b"]}', "--twist", "off"], None),
        (["--schema", '{"enum": ["a", "b"]}', "--twist", "lookahead"], "lookahead"),
        (["--regex", "a|b"], None),
    ],
)
def test_a_schema_on_the_command_line_runs_the_finite_twist_unless_told(flags, ran):
    from smcsd_ppl.cli import build_parser
    from smcsd_ppl.cli.options import read_constraint, smc_config

    for command in (["generate", "hi"], ["batch", "prompts.jsonl", "--out", "out.jsonl"]):
        args = build_parser().parse_args([*command, *flags])
        assert smc_config(args).twist_on(read_constraint(args)) == ran


class Extend(SMCSDModel):
    async def step(self):
        await self.extend()


def read_as(row) -> str | None:
    """The estimated twist a block's constraint asks for (None: none)."""
    if not row.lookahead:
        return None
    return "finite" if row.finite else "structure" if row.structure else "lookahead"


@pytest.mark.parametrize(
    ("kind", "twist", "ran"),
    [
        ("schema", "auto", "finite"),
        ("schema", None, None),
        ("regex", "auto", None),
        ("schema", "structure", "structure"),
    ],
)
def test_a_json_schema_program_runs_the_finite_twist_unless_told(monkeypatch, kind, twist, ran):
    # SMCConfig's default twist, "auto", is each constraint's own: a JSON schema's is finite.
    from tiny import pair

    from smcsd_ppl.api import SMCSD
    from smcsd_ppl.potentials import JsonSchemaConstraint, RegexConstraint

    seen, row_constraint = set(), SMCSDModel._row_constraint

    def spy(*args):
        row = row_constraint(*args)
        seen.add(read_as(row))
        return row

    monkeypatch.setattr(SMCSDModel, "_row_constraint", spy)
    smcsd = SMCSD(*pair())
    make, language = (
        (JsonSchemaConstraint, {"enum": ["ab", "ba"]}) if kind == "schema" else (RegexConstraint, '"(ab|ba)"')
    )
    constraint = make(language, smcsd.tokenizer, smcsd.eos_token_ids)
    config = SMCConfig(block_size=2, max_new_tokens=8, twist=twist)
    smcsd.run([Extend([1, 2, 3], constraint) for _ in range(2)], config)
    assert seen == {ran}

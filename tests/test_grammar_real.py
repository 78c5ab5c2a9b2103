"""Grammar-conditional exactness on a real model: the exact laws of a finite language.

The batched walk over every allowed token path must give, on the mock grammar, exactly the
laws the recursive enumeration of ``bench.grammar_exact`` gives (the joint p x phi and locally
masked decoding's). On the embedded target, the shipped languages must put masked decoding
at least 0.2 from the conditional, with the walk's dropped mass negligible.
"""

from __future__ import annotations

import math

import pytest

from smcsd_ppl.bench import grammar_exact as ge
from smcsd_ppl.bench import grammar_real as gr
from smcsd_ppl.cli.main import main


@pytest.mark.parametrize("local", [False, True])
def test_the_batched_walk_gives_the_enumeration_s_laws(local):
    target, _ = ge.dyck_pair(0)
    constraint = ge.BalancedBrackets()
    want = ge._outputs(target, constraint, local)
    found = gr.walk(target, ge.PROMPT, constraint, local=local, floor=1e-300)
    got = {path + (ge.EOS,): math.exp(lp) for path, lp in found["done"]}
    assert found["pruned"] == 0.0 and set(got) == set(want)
    assert max(abs(got[y] - want[y]) for y in want) < 1e-9
    other = ge._outputs(target, constraint, not local)  # the test tells the two laws apart
    assert max(abs(got[y] - other[y]) for y in want) > 0.01


def test_the_floor_drops_paths_and_bounds_their_mass():
    target, _ = ge.dyck_pair(0)
    constraint = ge.BalancedBrackets()
    full = ge._outputs(target, constraint, False)
    found = gr.walk(target, ge.PROMPT, constraint, local=False, floor=1e-3)
    kept = sum(math.exp(lp) for _, lp in found["done"])
    # A dropped prefix carries its whole mass, the part that would have left the language too.
    assert found["pruned"] > 0 and kept < sum(full.values()) <= kept + found["pruned"]


def test_the_shipped_languages_put_masked_decoding_far_from_the_conditional(default_smcsd):
    for language in gr.LANGUAGES.values():
        ref = gr.reference(default_smcsd, language)
        assert sum(ref.conditional.values()) == pytest.approx(1.0)
        assert sum(ref.masked.values()) + ref.masked_pruned == pytest.approx(1.0, abs=1e-6)
        assert ref.pruned < 1e-4 and ref.masked_pruned < 1e-3, language.name
        assert set(ref.conditional) <= set(language.choices), language.name
        assert ge.total_variation(ref.conditional, ref.masked) >= 0.2, language.name


def test_the_command_prints_a_table_per_language(capsys):
    argv = ["grammar-exactness", "--grammar", "planet", "--particles", "1", "--twists", "off", "--runs", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "planet: 'Which planet is closest to the sun?'" in out and "| 1 | " in out
    assert main(["grammar-exactness", "--grammar", "planet", "--cuts", "0.3"]) != 0
    assert "a real language runs proposal mode" in capsys.readouterr().err

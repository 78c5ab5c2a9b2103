"""Grammar-conditional exactness on a real model: the exact laws of a finite language.

The batched walk over every allowed token path must give, on the mock grammar, exactly the
laws the recursive enumeration of ``bench.grammar_exact`` gives (the joint p x phi and locally
masked decoding's). On the embedded target, the shipped languages must put masked decoding
at least 0.2 from the conditional, with the walk's dropped mass negligible. Served json_schema
requests on the tiny pair must follow their target's exact conditional law within the mock
grammars' bound.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import httpx
import pytest
import tiny

from smcsd_ppl.api import SMCSD
from smcsd_ppl.bench import grammar_exact as ge
from smcsd_ppl.bench import grammar_real as gr
from smcsd_ppl.cli.main import main
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.engine.client import Engine
from smcsd_ppl.serving.app import build_app
from smcsd_ppl.serving.server import BackgroundServer


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
    assert main(["grammar-exactness", "--grammar", "planet", "--plot", "tv.png"]) != 0
    assert "--plot are the mock cases' own" in capsys.readouterr().err


def test_an_interrupted_command_keeps_the_tables_it_finished(capsys, monkeypatch):
    finished = gr.real_exactness

    def interrupted_at_color(pair, languages, *args, **kw):
        if languages[0].name == "color":
            raise KeyboardInterrupt
        return finished(pair, languages, *args, **kw)

    monkeypatch.setattr(gr, "real_exactness", interrupted_at_color)
    argv = ["grammar-exactness", "--grammar", "planet,color", "--particles", "1", "--twists", "off"]
    with pytest.raises(KeyboardInterrupt):
        main([*argv, "--runs", "2"])
    assert "| 1 | " in capsys.readouterr().out.split("planet: ")[1]


EXACT_BOUND = 0.05  # the mock grammars' bar for an exact twist at N = 8 (tests/test_twist_exact.py)
SERVED_RUNS = 960  # 30 requests of n = 32: sampling noise 0.015 TV here


@pytest.mark.slow
def test_served_json_enums_follow_the_target_s_conditional_law():
    # A JSON enum opens with a forced quote; the value's first token comes after it, so it is
    # the structure read's tilt of the drafted tokens and the bonus, not only the lead's, that
    # steers it. The tiny random pair serves it (real tokenizer, exact law by enumeration), under
    # a schema's default twist (``finite``: an enum's rest is finite, so it is read throughout).
    pair = SMCSD(*tiny.pair())
    words = ("cat", "dog", "mat")
    language = gr.Language("enum", "The quick brown", tuple(json.dumps(w) for w in words))
    ref = gr.reference(pair, language)
    assert ge.total_variation(ref.conditional, ref.masked) > 0.4  # masked decoding is far off
    schema = {"type": "json_schema", "json_schema": {"name": "word", "schema": {"enum": list(words)}}}
    defaults = SMCConfig(n_particles=8, max_new_tokens=12, draft_temperature=1.0, target_temperature=1.0)
    engine = Engine(pair.core, defaults, max_queue=8, max_rows=512)
    pair.use_engine(engine)
    laws = {}
    try:
        app = build_app(engine, model_name="tiny", defaults=defaults)
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=300) as client:
            for twist in ("default", "off"):  # the schema's default twist: the request names none
                counts: Counter = Counter()
                for start in range(0, SERVED_RUNS, 32):
                    ask = {"prompt": pair.encode(language.prompt), "n": 32, "seed": start}
                    ask |= {"response_format": schema} | ({"twist": twist} if twist == "off" else {})
                    response = client.post("/v1/completions", json=ask)
                    assert response.status_code == 200, response.text
                    for choice in response.json()["choices"]:
                        assert choice["smcsd"]["twist"] == (None if twist == "off" else "finite")
                        counts[choice["text"]] += 1
                laws[twist] = {text: c / SERVED_RUNS for text, c in counts.items()}
    finally:
        pair.close()
    noise = ge.sampling_noise(ref.conditional, SERVED_RUNS, 0)
    assert ge.total_variation(ref.conditional, laws["default"]) < EXACT_BOUND + noise, (laws, noise)
    # The control: without the twist, eight particles do not get there on this language.
    assert ge.total_variation(ref.conditional, laws["off"]) > EXACT_BOUND + noise, (laws, noise)

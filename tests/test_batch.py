"""``smcsd batch`` and its library half: full outputs, per-prompt seeds, resume, settings checked."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from smcsd_ppl import SMCConfig
from smcsd_ppl.batch import Prompt, run_batch
from smcsd_ppl.cli import batch as cli_batch
from smcsd_ppl.cli import main
from smcsd_ppl.potentials.spec import ConstraintSpec

CONFIG = SMCConfig(
    n_particles=2, block_size=2, max_new_tokens=4, draft_temperature=0.7, target_temperature=0.7
)
PROMPTS = [
    Prompt(str(i), text, "story")
    for i, text in enumerate(["The quick brown fox", "Once upon", "The sun", "Rain falls"])
]
SAME = ("prompt_id", "seed", "text", "new_tokens", "log_z", "message")  # what two runs must agree on


pytestmark = pytest.mark.usefixtures("one_thread")


def outputs(records) -> dict:
    return {r["prompt_id"]: tuple(r.get(f) for f in SAME) for r in records}


def test_a_resumed_batch_holds_what_one_run_writes_in_any_order(tiny_smcsd, tmp_path):
    whole = run_batch(tiny_smcsd, PROMPTS, tmp_path / "whole.jsonl", CONFIG)
    assert whole.resumed == 0 and whole.failed == 0 and len(whole.records) == len(PROMPTS)
    assert len({r["seed"] for r in whole.records}) == len(PROMPTS)  # each prompt its own seed
    assert all(r["mean_ess"] is not None and "log_z" in r for r in whole.records)  # SMC's report kept
    out = tmp_path / "split.jsonl"

    def stop_after_two(_record, done, _total):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_batch(tiny_smcsd, PROMPTS, out, CONFIG, on_record=stop_after_two)
    with out.open("a") as f:
        f.write('{"prompt_id": "2", "te')  # a line cut short by a kill
    again = run_batch(tiny_smcsd, PROMPTS[::-1], out, CONFIG)
    assert again.resumed == 2 and len(again.records) == len(PROMPTS)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(PROMPTS) and outputs(lines) == outputs(whole.records)


def test_a_file_of_other_settings_or_prompts_is_refused(tiny_smcsd, tmp_path):
    out = tmp_path / "r.jsonl"
    run_batch(tiny_smcsd, PROMPTS[:1], out, CONFIG)
    size = out.stat().st_size
    for field, change in [("base_seed", dict(seed=3)), ("n_particles", dict(n_particles=3))]:
        with pytest.raises(ValueError, match=f"made with {field}="):
            run_batch(tiny_smcsd, PROMPTS, out, dataclasses.replace(CONFIG, **change))
    with pytest.raises(ValueError, match="made with method="):
        run_batch(tiny_smcsd, PROMPTS, out, CONFIG, method="ar")
    with pytest.raises(ValueError, match="made with constraint="):
        run_batch(tiny_smcsd, PROMPTS, out, CONFIG, constraint=ConstraintSpec("regex", "[a-z ]+"))
    with pytest.raises(ValueError, match="prompt '0' has another text"):
        run_batch(tiny_smcsd, [Prompt("0", "Another text", "story")], out, CONFIG)
    assert out.stat().st_size == size
    (tmp_path / "bench.jsonl").write_text('{"method": "ar"}\n')
    with pytest.raises(ValueError, match="not a record of smcsd batch"):
        run_batch(tiny_smcsd, PROMPTS, tmp_path / "bench.jsonl", CONFIG)


def test_constrained_batches_and_their_one_line_errors(tiny_smcsd, tmp_path):
    words = ConstraintSpec("regex", "[a-z]+( [a-z]+)*")
    done = run_batch(tiny_smcsd, PROMPTS, tmp_path / "r.jsonl", CONFIG, constraint=words)
    for r in done.records:
        assert re.fullmatch("[a-z]+( [a-z]+)*", r["text"]) or r["message"], r
    with pytest.raises(ValueError, match="cannot compile regex"):
        run_batch(
            tiny_smcsd, PROMPTS, tmp_path / "bad.jsonl", CONFIG, constraint=ConstraintSpec("regex", "(a")
        )
    with pytest.raises(ValueError, match="smcsd method only"):
        run_batch(tiny_smcsd, PROMPTS, tmp_path / "ar.jsonl", CONFIG, method="ar", constraint=words)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "--schema", '{"type": "object"', "Hi"], "--schema: the JSON schema is not valid JSON"),
        (["generate", "--schema", "missing.json", "Hi"], "--schema missing.json: no such file"),
        (["generate", "--schema", "[1, 2]", "Hi"], "--schema missing"),
        (["generate", "--grammar", "missing.lark", "Hi"], "--grammar missing.lark: no such file"),
        (["generate", "--regex", "a+", "--method", "sd", "Hi"], "--regex runs with --method smcsd only"),
        (["batch", "missing.jsonl", "--out", "o.jsonl"], "dataset file 'missing.jsonl' does not exist"),
    ],
)
def test_constraint_options_fail_in_one_line_before_loading(argv, needle, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    if needle == "--schema missing":
        needle = "--schema [1, 2]: no such file"  # only an object's text is read as a schema
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_the_constraint_options_exclude_each_other():
    with pytest.raises(SystemExit):
        main(["generate", "--regex", "a+", "--schema", "{}", "Hi"])


@pytest.fixture(scope="module")
def model_dir(tiny_smcsd, tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_smcsd.target.model.save_pretrained(path)
    tiny_smcsd.target.tokenizer.save_pretrained(path)
    return path


def models(path) -> list[str]:
    return ["--target", str(path), "--draft", "layers:1", "--dtype", "fp32", "--threads", "1"]


def test_the_cli_generates_under_a_schema_with_its_diagnostics(model_dir, capsys, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(
        json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]})
    )
    argv = ["generate", "--schema", str(schema), "--json", "-n", "2", "-k", "2", "--max-new-tokens", "12"]
    assert main(argv + models(model_dir) + ["The fox"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert {"mean_ess", "log_z", "n_resamples", "draft_lengths", "message"} <= set(record)
    assert record["message"] or json.loads(record["text"])["a"] in ("x", "y")
    assert main(["generate", "--regex", "(a", *models(model_dir), "The fox"]) == 2
    assert "smcsd: error: --regex: cannot compile regex '(a': unclosed group" in capsys.readouterr().err


def test_the_batch_command_runs_resumes_and_sums_up(model_dir, capsys, tmp_path, monkeypatch):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"The fox {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "r.jsonl"
    argv = [
        "batch",
        str(data),
        "--out",
        str(out),
        "-n",
        "2",
        "-k",
        "2",
        "--max-new-tokens",
        "3",
        *models(model_dir),
    ]
    assert main(argv) == 0
    assert "3 prompts in" in capsys.readouterr().err and len(out.read_text().splitlines()) == 3
    assert main(argv) == 0
    assert "(0 run now, 3 resumed from the file)" in capsys.readouterr().err

    def loading(_args):
        raise AssertionError("models loaded for a run that is refused")

    monkeypatch.setattr(cli_batch, "load_pair", loading)  # other settings: refused before any model loads
    assert main([*argv, "--seed", "1"]) == 2
    assert capsys.readouterr().err.startswith(
        "smcsd: error: the output file holds records made with base_seed=0, this run has 1;"
    )
    data.write_text(json.dumps({"id": "q0", "prompt": "Another fox"}) + "\n")
    assert main(argv) == 2
    assert "prompt 'q0' has another text" in capsys.readouterr().err


def test_to_record_holds_the_text_cost_and_report_of_each_method_family(tiny_smcsd):
    common = {"text", "method", "new_tokens", "seconds", "tokens_per_second", "tokens_per_target_call"}
    common |= {"target_calls", "draft_calls", "overhead_fraction", "message", "finish_reason"}
    smc = {"n_resamples", "mean_ess", "log_z", "collapsed", "draft_lengths", "proposals"}
    for method, extra in [("smcsd", smc), ("sd", {"acceptance"}), ("ar", set())]:
        out = tiny_smcsd.generate("The quick brown fox", method=method, config=CONFIG)
        record = out.to_record()
        assert set(record) == common | extra and record["text"] == out.text, method
        assert record["finish_reason"] in ("eos", "length"), method
        json.dumps(record)

"""Bad input through the Python API: one clear ValueError, never a stray exception type."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import tiny
import torch

from smcsd_ppl import SMCSD, SMCConfig, SMCSDModel, smc
from smcsd_ppl.bench import Grid, Prompt, run_bench
from smcsd_ppl.potentials import RegexConstraint

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda p: p.generate(b"Hi"), "got bytes"),
        (lambda p: p.generate([]), "no prompts"),
        (lambda p: p.generate("caf\udce9"), "lone surrogate"),
        (lambda p: p.run([SMCSDModel([1, 10**9])]), "token ids must be integers in [0, "),
        (lambda p: p.run([SMCSDModel([-1])]), "token ids must be integers in [0, "),
        (lambda p: p.run([SMCSDModel([])]), "prompt is empty"),
    ],
    ids=["bytes", "empty list", "lone surrogate", "id over the vocabulary", "negative id", "no ids"],
)
def test_bad_prompts(tiny_smcsd, call, needle):
    with pytest.raises(ValueError) as info:
        call(tiny_smcsd)
    assert needle in str(info.value) and type(info.value) is ValueError


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        (dict(seed=2**64), "seed must be at most"),
        (dict(draft_temperature=0.001), "draft_temperature must be at least 0.01"),
        (dict(target_temperature=1e-30), "target_temperature must be 0 \\(greedy\\) or at least 0.01"),
    ],
)
def test_config_bounds(settings, needle):
    with pytest.raises(ValueError, match=needle):
        SMCConfig(**settings)
    SMCConfig(seed=2**63 - 1, draft_temperature=0.01, target_temperature=0.01)  # the bounds themselves


@pytest.mark.parametrize(
    "log_w, shifted",  # the log-weights, and the same minus their max (exactly representable)
    [
        ([1e31] * 4, [0.0] * 4),
        ([1e31, 1e31, -1e31, 0.0], [0.0, 0.0, -math.inf, -math.inf]),
        ([1e17, 1e17 + 16, 0.0], [-16.0, 0.0, -math.inf]),
        ([-1e300, -1e300], [0.0, 0.0]),
        ([5e15, 5e15 + 1.0, 0.0], [-1.0, 0.0, -math.inf]),
    ],
)
def test_ess_of_huge_log_weights_is_that_of_their_differences(log_w, shifted):
    w = torch.tensor(log_w, dtype=torch.float64)
    assert smc.normalize(w).sum().item() == pytest.approx(1.0, abs=1e-12)
    expected = torch.softmax(torch.tensor(shifted, dtype=torch.float64), 0)
    assert smc.ess(w) == pytest.approx(float(1.0 / (expected * expected).sum()), rel=1e-9)


# --- benchmark files are bound to their settings ---------------------------------------------

PROMPTS = [Prompt("a", "The quick brown fox", "story"), Prompt("b", "Once upon a time", "story")]
BASE = SMCConfig(max_new_tokens=4)


def test_bench_refuses_records_of_other_settings_or_prompt_texts(tiny_smcsd, tmp_path):
    out = tmp_path / "r.jsonl"
    grid = Grid(["ar", "smcsd"], (2,), (2,), (0.7,), BASE)
    first = run_bench(tiny_smcsd, PROMPTS, grid, out, warmup=False)
    assert all(r["prompt_sha"] for r in first) and all(r["base_seed"] == 0 for r in first)
    size = out.stat().st_size
    changes = [
        ("base_seed", dict(seed=5)),
        ("ess_threshold", dict(ess_threshold=0.3)),
        ("alpha", dict(alpha=2.0)),
        ("resampling", dict(resampling="multinomial")),
        ("ignore_eos", dict(ignore_eos=True)),
        ("selection", dict(selection="argmax")),
    ]
    for field, change in changes:
        other = dataclasses.replace(grid, base=dataclasses.replace(BASE, **change))
        with pytest.raises(ValueError, match=f"made with {field}="):
            run_bench(tiny_smcsd, PROMPTS, other, out, warmup=False)
    with pytest.raises(ValueError, match="made with chat="):
        run_bench(SMCSD(tiny_smcsd.target, tiny_smcsd.draft, chat=False), PROMPTS, grid, out, warmup=False)
    half = SMCSD(*tiny.pair(dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="made with dtype="):
        run_bench(half, PROMPTS, grid, out, warmup=False)
    edited = [PROMPTS[0], Prompt("b", "Twice upon a time", "story")]
    with pytest.raises(ValueError, match="prompt 'b' has another text"):
        run_bench(tiny_smcsd, edited, grid, out, warmup=False)
    assert out.stat().st_size == size  # nothing written by a refused run
    assert len(run_bench(tiny_smcsd, PROMPTS, grid, out)) == len(first)  # the same settings resume


@pytest.mark.slow
def test_bench_cli_counts_failures_and_fails_when_all_fail(tiny_smcsd, tmp_path):
    model_dir = tmp_path / "target"
    tiny_smcsd.target.model.save_pretrained(model_dir)
    tiny_smcsd.target.tokenizer.save_pretrained(model_dir)
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"id": "long", "prompt": "the fox " * 400}) + "\n")
    out = tmp_path / "r.jsonl"
    cmd = [sys.executable, "-m", "smcsd_ppl", "bench", "--dataset", str(data), "--out", str(out)]
    cmd += ["--target", str(model_dir), "--draft", "layers:1", "--dtype", "fp32", "--threads", "1"]
    cmd += ["--methods", "ar", "--max-new-tokens", "4"]
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 1, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "1 records (1 failed)" in last and "Traceback" not in run.stderr
    assert "context" in run.stderr  # the first failure's reason is shown


def test_a_constrained_output_cut_by_the_budget_says_it_is_incomplete(tiny_smcsd):
    cfg = SMCConfig(n_particles=2, block_size=2, max_new_tokens=3)
    words = RegexConstraint("[a-z]+( [a-z]+){9}", tiny_smcsd.tokenizer, tiny_smcsd.eos_token_ids)
    [out] = tiny_smcsd.run([SMCSDModel("The quick brown fox", words)], cfg)
    assert out.text and out.message.startswith("incomplete: max_new_tokens (3) ran out")
    anything = RegexConstraint("[a-z ]*", tiny_smcsd.tokenizer, tiny_smcsd.eos_token_ids)  # all complete
    [out] = tiny_smcsd.run([SMCSDModel("The quick brown fox", anything)], cfg)
    assert out.message == ""


@pytest.mark.slow
def test_generate_reads_standard_input_and_json_has_the_message(tiny_smcsd, tmp_path):
    model_dir = tmp_path / "target"
    tiny_smcsd.target.model.save_pretrained(model_dir)
    tiny_smcsd.target.tokenizer.save_pretrained(model_dir)
    cmd = [sys.executable, "-m", "smcsd_ppl", "generate", "-", "--json", "--max-new-tokens", "3"]
    cmd += ["--target", str(model_dir), "--draft", "layers:1", "--dtype", "fp32", "--threads", "1"]
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        cmd, input="The quick brown fox", capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert "message" in record and 1 <= record["new_tokens"] <= 3


def test_backend_is_checked_and_a_missing_vllm_names_its_extra(tiny_models, monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'tpu'; choose from hf, vllm"):
        SMCSD(*tiny_models, backend="tpu")
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install 'smcsd_ppl\[vllm\]' on a GPU"):
        SMCSD(*tiny_models, backend="vllm")

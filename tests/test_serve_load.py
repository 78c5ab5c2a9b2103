"""The load test: its checks catch answers that are missing, doubled or another request's; a small run."""

from __future__ import annotations

import json

import pytest

from smcsd_ppl.bench.load import check_answers, summarize_level, workload
from smcsd_ppl.cli import main


def answers(requests) -> list[dict]:
    """Records of every request answered correctly."""
    return [
        {
            "index": r.index,
            "echoed_seed": r.seed,
            "prompt_tokens": 30 + r.index,
            "completion_tokens": 8,
            "finish_reason": "stop",
            "text": f"Request {r.index}: fine." if r.constrained else "anything",
            "latency": 1.0 + r.index,
            "ttft": 0.5 if r.stream else None,
        }
        for r in requests
    ]


def test_the_checks_pass_right_answers_and_catch_wrong_ones():
    requests = workload(8)
    right = answers(requests)
    reference = {r["index"]: r for r in right}
    assert check_answers(right, requests, reference) == []
    swapped = [dict(r) for r in right]
    swapped[0]["echoed_seed"], swapped[3]["echoed_seed"] = (
        swapped[3]["echoed_seed"],
        swapped[0]["echoed_seed"],
    )
    assert len(check_answers(swapped, requests, reference)) == 2
    doubled = right[:-1] + [right[0]]
    assert any("once" in p for p in check_answers(doubled, requests, reference))
    other_prompt = [dict(r) for r in right]
    other_prompt[5]["prompt_tokens"] += 1
    assert check_answers(other_prompt, requests, reference) == [
        "request 5 reports another prompt's 36 tokens"
    ]
    other_text = [dict(r) for r in right]
    other_text[1]["text"] = "Request 2: fine."  # request 1 is constrained
    assert len(check_answers(other_text, requests, reference)) == 1
    failed = right[:-1] + [{"index": 7, "error": "boom", "latency": 1.0}]
    assert check_answers(failed, requests, reference) == ["request 7 failed: boom"]


def test_a_level_summary_counts_tokens_over_wall_time():
    requests = workload(4)
    right = answers(requests)
    summary = summarize_level(2, right, 4.0, {r["index"]: r for r in right})
    assert summary["tokens_per_second"] == 8.0 and summary["latency_p50"] == 2.5
    assert summary["ttft_p50"] == 0.5 and summary["same_as_sequential"] == 1.0


@pytest.mark.slow
def test_a_small_load_test_runs_end_to_end(tmp_path, capsys):
    args = ["load-test", "--out-dir", str(tmp_path), "--requests", "4", "--levels", "1,2"]
    assert main([*args, "--max-new-tokens", "8", "--threads", "1"]) == 0, capsys.readouterr().err
    table = capsys.readouterr().out
    assert "| one batch | 4 |" in table and table.count("\n") == 5
    rows = [json.loads(line) for line in (tmp_path / "load.jsonl").read_text().splitlines()]
    requests = [r for r in rows if r["kind"] == "request"]
    assert sorted((r["clients"], r["index"]) for r in requests) == [(c, i) for c in (1, 2) for i in range(4)]
    assert all(r["text"] and r["completion_tokens"] >= 1 for r in requests)
    assert (tmp_path / "load.png").stat().st_size > 10_000

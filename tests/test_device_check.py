"""The one-shot device check runs on the CPU with tiny shapes, so it cannot rot."""

from __future__ import annotations

import json
import resource

import pytest
import torch

from smcsd_ppl.bench import device_check
from smcsd_ppl.cli import main


def _peak_rss() -> int:
    """This process's peak RSS in bytes (getrusage gives KiB on Linux, where the tests run)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.slow
def test_device_check_prints_one_json_report(capsys):
    peak_before = _peak_rss()
    code = main(["device-check", "--tiny", "--device", "cpu", "--repeats", "1", "--max-new-tokens", "24"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["equivalence_ok"]
    assert set(report["equivalence_max_rel_err"]) == {"left_padding", "holes", "fork", "drop_tail", "tree"}
    assert set(report["methods"]) == set(device_check.TIMED)
    assert report["methods"]["ar"]["tokens_per_target_call"] == 1.0
    assert report["methods"]["smcsd_paper"]["tokens_per_target_call"] > 1.0
    assert report["methods"]["ar"]["host_reads_per_cycle"] == 1.0
    assert set(report["forward_ms"]) == {"1x1", "8x9"} and all(ms > 0 for ms in report["forward_ms"].values())
    # The CPU peak is this process's peak RSS, in bytes: between the peaks before and after the check.
    assert peak_before <= report["peak_memory_bytes"] <= _peak_rss()


def test_equivalence_catches_a_backend_that_lets_holes_show(monkeypatch):
    # A mask that lets every token see every written column (holes and stale tails included).
    real_plan = device_check.HFBatchedLM.__init__.__globals__["plan"]

    def leaky(length, valid, width):
        dest, positions, allowed = real_plan(length, valid, width)
        return dest, positions, torch.ones_like(allowed)

    monkeypatch.setitem(device_check.HFBatchedLM.__init__.__globals__, "plan", leaky)
    model = device_check.build("tiny-target", 512, "cpu", seed=0).model
    errors = device_check.equivalence(model, 512)
    assert max(errors.values()) > device_check.BF16_TOL


@pytest.mark.slow
def test_device_check_times_our_forward_beside_the_models_own(capsys):
    argv = ["device-check", "--tiny", "--device", "cpu", "--repeats", "1", "--max-new-tokens", "16"]
    code = main(argv)
    ours = json.loads(capsys.readouterr().out)["ours"]
    assert code == 0 and ours["forward"] == "auto"
    assert max(ours["equivalence_max_rel_err"].values()) <= device_check.BF16_TOL
    assert set(ours["forward_ms"]) == {"1x1", "8x9"}
    assert set(ours["methods"]) == set(device_check.OURS_TIMED)
    assert ours["methods"]["smcsd"]["host_reads_per_cycle"] <= 1.0
    assert set(ours["served"]) == {"ar x8", "smcsd x8"} and all(v > 0 for v in ours["served"].values())

"""torch's CPU threads on a busy machine: the library lowers them (one warning), the CLI the same way."""

from __future__ import annotations

import argparse
import os
import warnings

import pytest
import torch

from smcsd_ppl import api
from smcsd_ppl.cli.loading import set_threads
from smcsd_ppl.models import threads as th


@pytest.fixture
def machine(monkeypatch):
    """A 4-core machine whose load average the test sets; torch at one thread per core."""
    before = torch.get_num_threads()
    load = [0.0]
    monkeypatch.setattr(th, "available_cores", lambda: 4)
    monkeypatch.setattr(th, "check_threads", lambda threads: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    for name in th._THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(4)
    yield load
    torch.set_num_threads(before)


def test_free_cores():
    assert [th.free_cores(load, 4) for load in (0.0, 0.4, 1.6, 3.0, 9.0)] == [4, 4, 2, 1, 1]


def test_a_quiet_machine_keeps_torchs_threads(machine):
    machine[0] = 0.3
    assert th.choose_threads() is None and torch.get_num_threads() == 4


def test_a_busy_machine_runs_the_free_cores(machine):
    machine[0] = 2.8
    choice = th.choose_threads()
    assert choice == th.ThreadChoice(1, 2.8, 4) and torch.get_num_threads() == 1
    assert choice.describe() == "the CPU is busy (load average 2.8 on 4 cores): torch runs 1 thread(s)"
    assert th.choose_threads() is None  # a count below the cores is someone's choice: kept


def test_a_chosen_count_is_kept(machine, monkeypatch):
    machine[0] = 3.0
    assert th.choose_threads(3) is None and torch.get_num_threads() == 3
    torch.set_num_threads(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert th.choose_threads() is None and torch.get_num_threads() == 4


def test_bad_counts_are_refused():
    for bad in (0, -1, 10**6, 1.5, True):
        with pytest.raises(ValueError, match="threads must be between 1 and the"):
            th.choose_threads(bad)


def test_load_warns_once_on_a_busy_machine(machine, monkeypatch, tiny_models):
    target, draft = tiny_models
    monkeypatch.setattr(api, "load_model", lambda *a, **k: target)
    monkeypatch.setattr(api, "resolve_draft", lambda *a, **k: draft)
    machine[0] = 3.5
    with pytest.warns(
        UserWarning, match=r"load average 3\.5 on 4 cores\): torch runs 1 thread\(s\); pass threads=N"
    ):
        api.SMCSD.load()
    assert torch.get_num_threads() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.SMCSD.load()  # chosen already: no second warning
        api.SMCSD.load(threads=2)
    assert torch.get_num_threads() == 2


def test_the_cli_makes_the_same_choice_and_says_so(machine, capsys):
    machine[0] = 2.2
    args = argparse.Namespace(threads=None, device="cpu")
    set_threads(args)
    assert args.threads == torch.get_num_threads() == 2
    assert "note: the CPU is busy (load average 2.2 on 4 cores): torch runs 2 thread(s); --threads N" in (
        capsys.readouterr().err
    )

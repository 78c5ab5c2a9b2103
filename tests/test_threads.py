"""torch's threads: the user's count or torch's own, never lowered behind their back; one thread works.

Every thread that runs torch operations gets an OpenMP team of its own, and two busy teams on
the same cores slow each other down; so every forward of every method runs on the process's
one torch thread, whichever thread called, and no thread stays busy once a call returns.
"""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from smcsd_ppl import SMCConfig, api
from smcsd_ppl.cli.loading import set_threads
from smcsd_ppl.engine.worker import torch_thread
from smcsd_ppl.methods import METHODS
from smcsd_ppl.models import threads as th


@pytest.fixture
def busy(monkeypatch, tiny_models):
    """Loads of the tiny pair on a machine whose load average is 9 and whose other processes use
    ``load[0]`` cores while the pair loads; no thread count chosen by the environment."""
    load = [0.0]

    class Watch:
        def stop(self):
            return th.OtherLoad(load[0], 4)

    target, draft = tiny_models
    monkeypatch.setattr(api, "load_model", lambda *a, **k: target)
    monkeypatch.setattr(api, "resolve_draft", lambda *a, **k: draft)
    monkeypatch.setattr(api, "LoadWatch", Watch)
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    yield load
    torch.set_num_threads(before)


def test_a_load_average_left_behind_changes_nothing(busy):
    """A load average of 9 (what a finished process leaves behind) neither pins nor warns."""
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.SMCSD.load()
    assert torch.get_num_threads() == threads


def test_other_processes_busy_during_the_load_earn_one_warning_and_no_pin(busy):
    threads = torch.get_num_threads()
    busy[0] = 1.5
    with pytest.warns(th.BusyCPUWarning, match=r"other processes kept 1\.5 of 4 CPU cores busy"):
        api.SMCSD.load()
    assert torch.get_num_threads() == threads
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.SMCSD.load(threads=1)  # chosen: no look at the load, the count kept
    assert torch.get_num_threads() == 1


def test_the_load_watch_excludes_the_process_own_work(monkeypatch):
    hz = os.sysconf("SC_CLK_TCK")
    readings = iter([(0, 0), (2 * hz, 2 * hz)])  # the machine busy on 2 cores, all of it this process
    monkeypatch.setattr(th, "_cpu_ticks", lambda: next(readings))
    times = iter([0.0, 1.0])
    monkeypatch.setattr(th.os, "times", lambda: type("T", (), {"elapsed": next(times)})())
    load = th.LoadWatch().stop()
    assert load.cores_used == 0.0 and not load.busy


def test_bad_counts_are_refused():
    for bad in (0, -1, 10**6, 1.5, True):
        with pytest.raises(ValueError, match="threads must be between 1 and the"):
            th.set_threads(bad)


def test_the_cli_sets_the_count_it_is_given_and_leaves_torchs_own_otherwise():
    before = torch.get_num_threads()
    try:
        set_threads(argparse.Namespace(threads=1, device="cpu"))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(before)
        set_threads(argparse.Namespace(threads=None, device="cpu"))
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def forward_threads(tiny_smcsd):
    """The threads every forward of the pair's two models ran on, while the fixture is in use."""
    seen: set[int] = set()
    hooks = [  # on the input embeddings: every forward calls them, ours and the model's own
        m.get_input_embeddings().register_forward_pre_hook(lambda *_: seen.add(threading.get_ident()))
        for m in (tiny_smcsd.target.model, tiny_smcsd.draft.model)
    ]
    yield seen
    for h in hooks:
        h.remove()


CONFIG = SMCConfig(max_new_tokens=6, n_particles=3, block_size=3, seed=1)


def test_every_method_runs_its_forwards_on_the_one_torch_thread(tiny_smcsd, forward_threads):
    """Called from this thread and from two others at once: one thread ran every forward."""
    for method in sorted(METHODS):
        tiny_smcsd.generate("hello", method=method, config=CONFIG)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda m: tiny_smcsd.generate("hello", method=m, config=CONFIG), ["smcsd", "ar"]))
    assert forward_threads == {torch_thread()._thread.ident}


def test_the_mutant_that_runs_a_method_on_the_callers_thread_fails_that_check(
    tiny_smcsd, forward_threads, monkeypatch
):
    monkeypatch.setattr(type(tiny_smcsd), "call", lambda self, fn: fn())
    tiny_smcsd.generate("hello", method="ar", config=CONFIG)
    assert threading.get_ident() in forward_threads


def test_no_thread_stays_busy_once_a_call_returns(tiny_smcsd):
    """After a call, the process uses (almost) no CPU: no spinning team, no polling loop."""
    for method in ("smcsd", "ar"):
        tiny_smcsd.generate("hello", method=method, config=CONFIG)
        time.sleep(0.2)  # an OpenMP team's spin after its last region ends well within this
        cpu = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - cpu < 0.05, method


def test_a_call_that_returns_nothing_leaves_the_engine_idle(tiny_smcsd):
    """A call's end is said, not inferred from its value: a held gate would stall a drain."""
    assert tiny_smcsd.engine.call(lambda: None) is None
    assert not tiny_smcsd.engine.busy
    with tiny_smcsd.engine.exclusive():  # its turn-holder returns None too
        pass
    assert not tiny_smcsd.engine.busy


def test_an_idle_torch_thread_keeps_nothing_of_its_last_job():
    """What a job held (its closure, its result) is let go when it ends, not when the next job comes.

    Else a pair its caller dropped keeps its weights while the thread waits.
    """

    class Held:
        pass

    held = Held()
    gone = weakref.ref(held)
    job = functools.partial(lambda obj: obj, held)  # holds it, as a method call holds its pair
    assert torch_thread().run(job) is held
    del held, job
    for _ in range(200):  # the thread lets go once it is back to waiting
        if gone() is None:
            break
        time.sleep(0.01)
    assert gone() is None

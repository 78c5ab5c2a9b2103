"""Fixtures shared by the test modules, named for what they are."""

from __future__ import annotations

import pytest
import tiny
import torch

from smcsd_ppl.api import SMCSD
from smcsd_ppl.config import DraftRecord


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="the whole suite: the slow tier too")


def pytest_collection_modifyitems(config, items):
    """The fast tier by default: tests marked ``slow`` run only with ``--full``."""
    if config.getoption("--full"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def pytest_report_header(config):
    full = config.getoption("--full")
    return "tier: full" if full else "tier: fast (slow tests deselected; --full runs the whole suite)"


@pytest.fixture(scope="session")
def tiny_models():
    """A tiny random target (3 layers) and draft (2 layers) sharing a tokenizer, as ``LoadedModel``s."""
    return tiny.pair()


@pytest.fixture(scope="session")
def tiny_llama():
    """A tiny random-weight Llama (3 layers) on the tiny tokenizer."""
    return tiny.llama(seed=0, layers=3)


@pytest.fixture(scope="session")
def tiny_smcsd(tiny_models):
    """``SMCSD`` over the tiny random pair (structure, counts and errors only: never quality)."""
    return SMCSD(*tiny_models)


@pytest.fixture(scope="session")
def eos_smcsd():
    """``SMCSD`` over a tiny pair whose EOS is frequent: particles stop inside blocks and as bonuses."""
    return SMCSD(*tiny.pair(eos_bias=8.0))


@pytest.fixture(scope="session")
def default_smcsd():
    """The real embedded default pair (SmolLM2-135M-Instruct and its distilled draft)."""
    return SMCSD.load()


@pytest.fixture(scope="session")
def default_smcsd_f32():
    """The embedded pair in float32: batch shapes then leave its logits' rounding alone."""
    return SMCSD.load(dtype="float32")


@pytest.fixture
def mm_calls(monkeypatch):
    """The shapes of the left operands of every ``torch.mm`` from now on (the weight-on-left products)."""
    calls, real_mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(a.shape) or real_mm(a, b))
    return calls


@pytest.fixture(scope="session", autouse=True)
def torch_on_one_thread():
    """Every test runs torch on one thread unless it sets its own count.

    Tiny models run several times faster on one thread than on two contended ones (a shared
    2-core machine), and left alone the count would depend on which test ran before: loading
    a pair lowers it on a busy machine and a module's ``one_thread`` puts it back.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``).

    Tiny models run ~10x faster on one thread than on two contended ones.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def pairs_start_without_memory(request):
    """A test that teaches a shared pair (``calibrate``, RACER's index) must not teach the next."""
    yield
    for name in ("tiny_smcsd", "eos_smcsd", "default_smcsd"):
        if name in request.fixturenames:
            pair = request.getfixturevalue(name)
            shipped = pair.draft.record if pair.draft is not None else None  # a distilled draft's own
            pair.draft_record, pair.retrieval_memory = shipped or DraftRecord(), None

"""The engine on the mock backend: requests join and leave a running batch, each on its own stream."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import Counter
from dataclasses import replace

import pytest
import torch
from helpers import EOS, config, exact_target, marginal_tv, mock_pair, total_variation

from smcsd_ppl.config import SMCConfig
from smcsd_ppl.engine.client import Engine, EngineClosed, QueueFull, RequestCancelled, ServeRequest
from smcsd_ppl.engine.pair import PairCore
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.rows import RowStore
from smcsd_ppl.inference.streams import RowStreams

PROMPTS = ([0, 1], [2], [1, 1, 0], [2, 0])


def MockPair() -> PairCore:
    """A pair core over the mock target and draft (token ids as letters)."""
    target, draft = mock_pair(rare_eos=True)
    return PairCore.over(RowStore(target, draft), [EOS], decode=lambda ids: "".join("abcd"[t] for t in ids))


def settings(seed: int, **kw) -> SMCConfig:
    return config(**{"seed": seed, "n_particles": 4, "block_size": 3, "max_new_tokens": 8} | kw)


def served(pair, requests, *, stagger: float = 0.0, **kw) -> list:
    """Each request's generation, submitted (``stagger`` s apart) to one scheduler."""
    with Engine(pair, settings(0), **kw) as sched:
        tickets = []
        for r in requests:
            tickets.append(sched.submit(r))
            time.sleep(stagger)
        return [t.wait(timeout=60) for t in tickets]


@pytest.mark.parametrize("cut", [None, 0.3])
def test_a_request_returns_the_same_alone_as_in_any_batch(cut):
    """Per-request streams: alone, all at once, or joining mid-run, the same tokens and weights."""
    requests = [ServeRequest(p, settings(10 + i, cut=cut)) for i, p in enumerate(PROMPTS)]
    base = replace(settings(0), cut=cut)
    alone = []
    for r in requests:
        with Engine(MockPair(), base) as sched:
            alone.append(sched.submit(r).wait(timeout=60))
    for batch in (served_with(base, requests), served_with(base, requests, stagger=0.01)):
        for a, b in zip(alone, batch):
            assert a.token_ids == b.token_ids
            assert a.smc.log_z == pytest.approx(b.smc.log_z)


def served_with(base, requests, stagger=0.0):
    with Engine(MockPair(), base) as sched:
        tickets = []
        for r in requests:
            tickets.append(sched.submit(r))
            time.sleep(stagger)
        return [t.wait(timeout=60) for t in tickets]


def test_a_mutant_sharing_one_stream_across_requests_changes_outputs(monkeypatch):
    """The test above can fail: draw every flush's uniforms from one generator, row after row."""

    def shared(self, n_rows, rows, width):
        return torch.rand(
            n_rows, width, generator=torch.Generator().manual_seed(len(self.plans)), dtype=torch.float64
        )

    monkeypatch.setattr(RowStreams, "table", shared)
    requests = [ServeRequest(p, settings(10 + i)) for i, p in enumerate(PROMPTS)]
    alone = [served_with(settings(0), [r])[0].token_ids for r in requests]
    together = [g.token_ids for g in served_with(settings(0), requests)]
    assert alone != together


def test_requests_join_mid_run_and_rows_are_reused():
    pair = MockPair()
    long = ServeRequest([0, 1], replace(settings(1), max_new_tokens=30, ignore_eos=False))
    with Engine(pair, settings(0), max_rows=12) as sched:
        first = sched.submit(long)
        while sched.stats().cycles_total < 2:
            time.sleep(0.001)
        late = [sched.submit(ServeRequest(p, settings(20 + i))) for i, p in enumerate(PROMPTS)]
        for t in [first, *late]:
            t.wait(timeout=60)
        stats = sched.stats()
    assert stats.requests_total["completed"] == 5
    assert stats.rows_in_use == 0 and stats.running == 0 and stats.queued == 0
    assert stats.tokens_total == sum(t.completion_tokens for t in [first, *late])


def test_the_row_cap_holds_requests_back_until_rows_free():
    with Engine(MockPair(), settings(0), max_rows=4) as sched:
        tickets = [sched.submit(ServeRequest(p, settings(i))) for i, p in enumerate(PROMPTS)]
        peak = 0
        while not all(t.done for t in tickets):
            peak = max(peak, sched.stats().rows_in_use)
            time.sleep(0.0005)
        assert all(t.wait().token_ids is not None for t in tickets)
    assert peak <= 4


def test_a_request_is_refused_only_beyond_the_rows_and_a_full_queue_and_a_closed_engine_too():
    gate = threading.Event()
    sched = Engine(MockPair(), settings(0), max_queue=1, max_rows=4)  # each request holds 4 rows

    def hold():
        with sched.exclusive():
            gate.wait()

    blocker = threading.Thread(target=hold)
    blocker.start()
    while sched.stats().queued:  # the blocking call has left the queue and runs
        time.sleep(0.001)
    queued = [sched.submit(ServeRequest([0], settings(i))) for i in range(2)]  # one fits, one waits
    with pytest.raises(QueueFull, match="wait for them"):
        sched.submit(ServeRequest([0], settings(9)))
    gate.set()
    blocker.join()
    assert all(t.wait(timeout=60) for t in queued)
    assert sched.stats().requests_total["rejected"] == 1
    sched.close()
    with pytest.raises(EngineClosed):
        sched.submit(ServeRequest([0], settings(0)))


def test_a_cancelled_request_leaves_and_frees_its_rows():
    long = replace(settings(1), max_new_tokens=40, ignore_eos=True)
    with Engine(MockPair(), replace(settings(0), ignore_eos=True)) as sched:
        doomed = sched.submit(ServeRequest([0, 1], long))
        other = sched.submit(ServeRequest([2], replace(long, max_new_tokens=12)))
        while sched.stats().cycles_total < 2:
            time.sleep(0.001)
        doomed.cancel()
        cut = doomed.wait(timeout=60)  # what it had settled, marked as cancelled
        assert cut.finish_reason == "cancelled" and len(cut.token_ids) < 40
        assert len(other.wait(timeout=60).token_ids) == 12
        stats = sched.stats()
    assert stats.requests_total["cancelled"] == 1 and stats.rows_in_use == 0


def test_close_with_cancel_ends_every_request():
    sched = Engine(MockPair(), replace(settings(0), ignore_eos=True))
    tickets = [
        sched.submit(ServeRequest([0], replace(settings(i), max_new_tokens=50, ignore_eos=True)))
        for i in range(3)
    ]
    sched.close(cancel=True)
    for t in tickets:
        assert t.done
        try:
            t.wait()
        except RequestCancelled:
            pass
    assert sched.stats().rows_in_use == 0


def test_stop_strings_end_the_output_before_them():
    gens = served(
        MockPair(),
        [ServeRequest([0, 1], replace(settings(s), max_new_tokens=12), stop=("c",)) for s in range(6)],
    )
    pair = MockPair()
    stopped = [g for g in gens if g.finish_reason == "stop"]
    assert stopped  # some stopped inside a block
    for g in gens:  # the tokens end where the text does
        assert "c" not in g.text and pair.decode(g.token_ids) == g.text


def test_other_settings_run_alone_between_batches():
    """A request whose shared settings differ runs on its own, with the same output as alone."""
    paper = ServeRequest([0, 1], replace(settings(3), cut=None))
    with Engine(MockPair(), settings(0)) as sched:
        together = [sched.submit(ServeRequest([2], settings(4))), sched.submit(paper)]
        got = [t.wait(timeout=60) for t in together]
    with Engine(MockPair(), replace(settings(0), cut=None)) as sched:
        assert sched.submit(paper).wait(timeout=60).token_ids == got[1].token_ids


def streamed(sched, request) -> tuple[str, object]:
    async def go():
        ticket = sched.submit(request)
        pieces = [p async for p in ticket.stream()]
        return "".join(pieces), await ticket.result()

    return asyncio.run(go())


def test_streamed_text_joins_into_the_final_text():
    with Engine(MockPair(), settings(0)) as sched:
        for s in range(20):
            text, gen = streamed(sched, ServeRequest([0, 1], replace(settings(s), max_new_tokens=10)))
            assert text == gen.text


RUNS = 1500


def streamed_runs(stream: bool) -> list[tuple[str, object]]:
    """RUNS requests (seeds 0..RUNS-1) through one scheduler, each streamed or waited for."""
    base = config(n_particles=3, block_size=1, ess_threshold=0.7, alpha=2.0, max_new_tokens=4, seed=0)

    async def one(sched, seed):
        ticket = sched.submit(ServeRequest([1, 2], replace(base, seed=seed)))
        if not stream:
            return None, await ticket.result()
        pieces = [p async for p in ticket.stream()]
        return "".join(pieces), await ticket.result()

    async def all_of(sched):
        return await asyncio.gather(*(one(sched, s) for s in range(RUNS)))

    with Engine(MockPair(), base, max_queue=RUNS) as sched:
        return asyncio.run(all_of(sched))


@pytest.mark.slow
def test_streaming_shows_shared_text_only_and_changes_no_output():
    """Enumeration: streamed requests are properly weighted for the target, the stream joins
    into the final text, and the same requests unstreamed return the same outputs."""
    runs = streamed_runs(stream=True)
    assert all(text == gen.text for text, gen in runs)
    quiet = streamed_runs(stream=False)
    assert [g.token_ids for _, g in runs] == [g.token_ids for _, g in quiet]
    target, _ = mock_pair(rare_eos=True)
    exact, z = exact_target(target, [1, 2], 4, alpha=2.0)
    est, total = Counter(), 0.0
    for _, gen in runs:
        zr = math.exp(gen.smc.log_z)
        w = torch.softmax(torch.tensor([p.log_weight for p in gen.smc.particles]), 0)
        for p, wi in zip(gen.smc.particles, w.tolist()):
            est[tuple(p.token_ids)] += zr * wi
        total += zr
    assert (
        total_variation({k: v / total for k, v in est.items()}, {k: v / z for k, v in exact.items()}) < 0.06
    )


def test_a_stream_of_one_particle_can_be_taken_back(monkeypatch):
    """The test above can fail: stream the first particle's tokens instead of the shared ones."""
    from smcsd_ppl.engine import core as module

    monkeypatch.setattr(module, "settled_tokens", lambda pop: tuple(pop.particles[0].token_ids))
    runs = streamed_runs(stream=True)
    assert any(text != gen.text for text, gen in runs)


def returned_through_scheduler(**cfg) -> list[tuple[str, object]]:
    """2000 streamed requests (plain programs, cut 0.3, N = 16) joining one scheduler: stream and result."""
    base = config(n_particles=16, block_size=4, cut=0.3, max_new_tokens=4, seed=0, **cfg)

    async def one(sched, seed):
        ticket = sched.submit(ServeRequest([1, 2], replace(base, seed=seed)))
        pieces = [p async for p in ticket.stream()]
        return "".join(pieces), await ticket.result()

    async def all_of(sched):
        return await asyncio.gather(*(one(sched, s) for s in range(2000)))

    with Engine(MockPair(), base, max_queue=2000) as sched:
        return asyncio.run(all_of(sched))


@pytest.mark.slow
def test_returned_outputs_of_streamed_requests_follow_the_target():
    """Enumeration on what the user gets back: the returned outputs' marginals against the target."""
    runs = returned_through_scheduler()
    assert all(text == gen.text for text, gen in runs)
    target, _ = mock_pair(rare_eos=True)
    exact, _ = exact_target(target, [1, 2], 4)
    assert marginal_tv([gen.token_ids for _, gen in runs], exact, 4) < 0.05


@pytest.mark.slow
def test_returning_the_heaviest_particle_fails_that_check():
    """The check above can fail: the heaviest particle, not one drawn by weight, is biased.

    The draft proposes every block: a plain request's retrieval is checked by the target, which
    leaves its particles equal (one of them, then), so only the draft's blocks weigh them apart.
    """
    runs = returned_through_scheduler(selection="argmax", proposal="draft")
    target, _ = mock_pair(rare_eos=True)
    exact, _ = exact_target(target, [1, 2], 4)
    assert marginal_tv([gen.token_ids for _, gen in runs], exact, 4) >= 0.05


def _finished_at(requests) -> list[int]:
    """The engine's cycle count when each request finished, all submitted at once to one engine."""
    done: dict[int, int] = {}
    with Engine(MockPair(), settings(0)) as sched:
        with sched.exclusive():  # held: every request is queued before the first cycle
            tickets = [
                sched.submit_program(
                    SMCSDModel(r.prompt_ids),
                    r.settings,
                    seed=r.config.seed,
                    on_done=lambda t, i=i: done.setdefault(i, sched.core.stats.cycles),
                )
                for i, r in enumerate(requests)
            ]
        [t.wait(timeout=60) for t in tickets]
    return [done[i] for i in range(len(requests))]


@pytest.mark.parametrize("odd", [{"block_size": 2}, {"ignore_eos": True}])
def test_a_request_of_its_own_k_or_eos_ahead_of_seven_holds_none_back(odd):
    """Counted in cycles: the seven finish when they would have without it."""
    seven = [ServeRequest(PROMPTS[i % 4], settings(20 + i)) for i in range(7)]
    ahead = ServeRequest([0, 1], settings(5, **odd, max_new_tokens=8))
    without = _finished_at(seven)
    with_it = _finished_at([ahead, *seven])
    assert with_it[1:] == without


def test_the_mutant_that_runs_other_k_in_a_batch_of_its_own_fails_that_check(monkeypatch):
    from smcsd_ppl.engine import request as request_module

    monkeypatch.setattr(request_module, "SHARED_SETTINGS", ("alpha", "block_size", "cut", "cut_divergence"))
    seven = [ServeRequest(PROMPTS[i % 4], settings(20 + i)) for i in range(7)]
    ahead = ServeRequest([0, 1], settings(5, block_size=2))
    assert max(_finished_at([ahead, *seven])[1:]) > max(_finished_at(seven))


@pytest.mark.parametrize("odd", [{"block_size": 2}, {"ignore_eos": True}, {"block_size": 5}])
def test_a_request_of_its_own_k_or_eos_returns_among_others_what_it_returns_alone(odd):
    mine = ServeRequest([0, 1], settings(5, **odd))
    others = [ServeRequest(PROMPTS[i % 4], settings(30 + i)) for i in range(3)]
    with Engine(MockPair(), settings(0)) as sched:
        alone = sched.submit(mine).wait(timeout=60)
    with Engine(MockPair(), settings(0)) as sched:
        tickets = [sched.submit(r) for r in (*others, mine)]
        together = [t.wait(timeout=60) for t in tickets][-1]
    assert together.token_ids == alone.token_ids and together.smc.log_z == pytest.approx(alone.smc.log_z)

"""The schedule as a value: who joins, who leaves and which call runs, decided without models."""

from __future__ import annotations

from smcsd_ppl.config import SMCConfig
from smcsd_ppl.engine.request import Call, Request
from smcsd_ppl.engine.scheduling import MAX_PASSED, Capacity, Plan, schedule
from smcsd_ppl.inference.program import SMCSDModel


def request(n: int = 4, **settings) -> Request:
    return Request(SMCSDModel([1, 2]), SMCConfig(n_particles=n, **settings), seed=0)


def test_waiting_requests_join_in_order_while_their_rows_fit():
    a, b, c = request(4), request(4), request(4)
    plan = schedule([a, b, c], [], Capacity(max_rows=8))
    assert plan == Plan(admit=(a, b))


def test_one_that_does_not_fit_holds_those_behind_it_back():
    running, big, small = request(4), request(8), request(2)
    assert schedule([big, small], [running], Capacity(max_rows=10)).admit == ()


def test_cancelled_requests_leave_and_cancelled_waiting_ones_never_run():
    running, gone = request(4), request(4)
    gone.cancelled = True
    waiting_gone, next_one = request(2), request(2)
    waiting_gone.cancelled = True
    plan = schedule([waiting_gone, next_one], [running, gone], Capacity(max_rows=8))
    assert plan.drop == (gone,) and plan.cancel == (waiting_gone,) and plan.admit == (next_one,)


def test_a_call_waits_for_the_batch_to_drain_and_holds_later_requests_back():
    running, call, later = request(2), Call(lambda: None), request(2)
    assert schedule([call, later], [running], Capacity(max_rows=64)) == Plan()
    assert schedule([call, later], [], Capacity(max_rows=64)) == Plan(call=call)


def test_a_request_of_other_settings_waits_for_the_batch_without_holding_back_those_behind():
    running, paper, same = request(2), request(2, cut=None), request(2)
    plan = schedule([paper, same], [running], Capacity(max_rows=64))
    assert plan.admit == (same,) and plan.passed == (paper,)
    plan = schedule([paper, same], [], Capacity(max_rows=64))
    assert plan.admit == (paper,)  # the first's settings start the batch; the other waits its turn


def test_a_request_passed_often_enough_has_the_batch_drain_for_it():
    running, paper, same = request(2), request(2, cut=None), request(2)
    paper.passed = MAX_PASSED
    assert schedule([paper, same], [running], Capacity(max_rows=64)) == Plan()


def test_other_k_and_eos_settings_share_the_batch():
    running = request(2)
    joining = [request(2, block_size=3), request(2, ignore_eos=True)]
    assert schedule(joining, [running], Capacity(max_rows=64)).admit == tuple(joining)


def test_a_drafting_request_waits_while_rows_without_the_draft_run():
    running, drafting, plain = request(2), request(2), request(2)
    plain.drafts = False
    capacity = Capacity(max_rows=64, draft_ready=False)
    assert schedule([drafting], [running], capacity).admit == ()
    assert schedule([plain], [running], capacity).admit == (plain,)
    assert schedule([drafting], [], capacity).admit == (drafting,)  # a new batch prefills the draft

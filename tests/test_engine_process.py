"""An engine in a process of its own answers as one in this process: outputs, streams, refusals, stop."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest
import tiny

from smcsd_ppl.config import SMCConfig
from smcsd_ppl.engine.client import Engine, EngineClosed, QueueFull, RequestCancelled, ServeRequest
from smcsd_ppl.engine.process import EngineProcess
from smcsd_ppl.serving.settings import PairSpec

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # a process per module

BASE = SMCConfig(n_particles=4, block_size=3, max_new_tokens=8)
PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]


@pytest.fixture(scope="module")
def child():
    with EngineProcess(PairSpec(factory=tiny.smcsd_pair), BASE, max_queue=1, max_rows=4) as engine:
        yield engine


def requests(seed: int = 0) -> list[ServeRequest]:
    return [ServeRequest(p, dataclasses.replace(BASE, seed=seed + i)) for i, p in enumerate(PROMPTS)]


def test_a_request_answers_in_the_child_as_in_this_process(child, tiny_smcsd):
    here = Engine(tiny_smcsd.core, BASE, max_rows=8)
    try:
        for request in requests():
            mine, theirs = here.submit(request).wait(timeout=120), child.submit(request).wait(timeout=120)
            assert mine.token_ids == theirs.token_ids and mine.text == theirs.text
            assert mine.finish_reason == theirs.finish_reason and mine.smc.log_z == pytest.approx(
                theirs.smc.log_z
            )
    finally:
        here.close()


def test_streams_join_into_the_final_text(child):
    async def streamed(request):
        ticket = child.submit(request)
        return "".join([p async for p in ticket.stream()]), await ticket.result()

    for request in requests(seed=10):
        text, gen = asyncio.run(streamed(request))
        assert text == gen.text


def test_refusals_come_at_once_in_the_callers_words(child):
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        child.submit(ServeRequest([10**9], BASE))
    with pytest.raises(ValueError, match="exceeds the model context"):
        child.submit(ServeRequest([5] * 200, BASE))
    tickets = [child.submit(r) for r in requests(seed=20)[:2]]  # the rows hold one, the queue one more
    with pytest.raises(QueueFull):
        child.submit(requests(seed=30)[0])
    assert all(t.wait(timeout=120).token_ids is not None for t in tickets)
    assert child.stats().requests_total["rejected"] == 1


def test_closing_cancels_what_runs_and_refuses_what_comes():
    engine = EngineProcess(PairSpec(factory=tiny.smcsd_pair), BASE)
    long = dataclasses.replace(BASE, max_new_tokens=100, ignore_eos=True)
    ticket = engine.submit(ServeRequest([5, 6], long))
    deadline = time.monotonic() + 60
    while engine.stats().cycles_total == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # until it runs: a request still waiting ends with RequestCancelled
    engine.close(cancel=True)
    gen = ticket.wait(timeout=120)  # its text so far
    assert gen.finish_reason == "cancelled" and len(gen.token_ids) < 100
    with pytest.raises(EngineClosed):
        engine.submit(ServeRequest([5, 6], BASE))


def test_a_constraint_is_compiled_once_in_the_child_not_in_the_server(child, monkeypatch):
    from smcsd_ppl.potentials.spec import ConstraintSpec

    def compiled_here(*_args, **_kwargs):
        raise AssertionError("the server's process compiled the constraint")

    monkeypatch.setattr(ConstraintSpec, "build", compiled_here)  # this process only; the child's is its own
    request = ServeRequest(PROMPTS[0], BASE, constraint=ConstraintSpec("regex", "[a-z]+"))
    out = child.submit(request).wait(timeout=120)
    assert out.text == "" or out.text.isalpha()


def test_an_engine_silent_with_work_in_is_killed_as_hung_and_idle_is_left_alone():
    engine = EngineProcess(PairSpec(factory=tiny.smcsd_pair), BASE, hang_seconds=1.0)
    try:
        os.kill(engine.pid, signal.SIGSTOP)  # a cycle that never ends, as a deadlocked kernel's
        time.sleep(2.5)
        assert engine.alive  # idle: it has nothing to say
        ticket = engine.submit(requests()[0])
        assert engine.died.wait(10) and "killed as hung" in engine.exit_note
        with pytest.raises(RequestCancelled):
            ticket.wait(timeout=10)
    finally:
        engine.close()


def test_health_and_new_requests_say_the_engine_is_dead_once_its_process_is_killed():
    from fastapi.testclient import TestClient

    from smcsd_ppl.serving.app import build_app

    engine = EngineProcess(PairSpec(factory=tiny.smcsd_pair), BASE)
    client = TestClient(build_app(engine, model_name="tiny"))  # no server around it: nothing stops
    try:
        assert client.get("/health").status_code == 200 and engine.alive
        os.kill(engine.pid, signal.SIGKILL)
        assert engine.died.wait(5)
        for reply in (client.get("/health"), client.post("/v1/completions", json={"prompt": "Hi"})):
            error = reply.json()["error"]
            assert reply.status_code == 503 and error["code"] == "engine_dead", error
            assert "the engine process ended (killed by signal 9)" in error["message"]
    finally:
        engine.close()


def test_a_reader_that_fails_turns_health_to_503_and_fails_what_is_in(monkeypatch):
    from fastapi.testclient import TestClient

    from smcsd_ppl.engine.ticket import Ticket
    from smcsd_ppl.serving.app import build_app

    def broken(self, out):
        raise RuntimeError("a reader bug")

    engine = EngineProcess(PairSpec(factory=tiny.smcsd_pair), BASE)
    client = TestClient(build_app(engine, model_name="tiny"))
    try:
        monkeypatch.setattr(Ticket, "apply", broken)
        ticket = engine.submit(requests()[0])
        assert engine.died.wait(5)
        reply = client.get("/health")
        assert reply.status_code == 503 and "reader of its outputs failed" in reply.json()["error"]["message"]
        with pytest.raises(RequestCancelled):
            ticket.wait(timeout=10)
    finally:
        engine.close()

"""Continuous batching: one owner of a pair's rows; requests join and leave between cycles.

A scheduler's thread runs the SMC loop over every running request at once (one fused target
forward a cycle). Callers submit from any thread and get a ``Ticket``. At each cycle boundary
the waiting requests are admitted (their prompts prefilled together, as rows after the
running ones) while the rows in use stay under ``max_rows``; finished requests leave with
their result, cancelled ones are dropped, and the row store keeps only the live rows. Each
request keeps its own settings and its own random numbers (``inference.streams``), so what
it returns does not depend on which requests shared its cycles. Settings that every row of a
cycle shares (``SHARED_SETTINGS``) are the scheduler's; a request that differs in them runs
alone, between batches, as do calls of other methods (``exclusive``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from ..config import SMCConfig
from ..inference.program import SMCSDModel
from ..inference.state import SMCState, settled_tokens
from ..inference.step import SMCSDKernel, request_seed
from ..results import Generation
from .outcomes import generation_of, rows_in_use, stopped_at
from .requests import (
    SERVE_METHODS,
    SHARED_SETTINGS,
    Job,
    QueueFull,
    SchedulerClosed,
    SchedulerStats,
    ServeRequest,
)
from .ticket import RequestCancelled, Ticket

__all__ = [
    "SERVE_METHODS",
    "SHARED_SETTINGS",
    "QueueFull",
    "RequestCancelled",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerStats",
    "ServeRequest",
]

IDLE_SECONDS = 2.0  # an idle scheduler's thread ends after this long


class Scheduler:
    """Runs SMC-SD for requests that come and go, on one pair's rows.

    Args:
        pair: an ``SMCSD`` pair (its backends' rows become the scheduler's).
        base: the settings every cycle shares (``SHARED_SETTINGS``) and each request's defaults.
        max_queue: requests that may wait for admission; more raise ``QueueFull``.
        max_rows: rows (particles times contexts) the running requests may hold.
    """

    def __init__(
        self, pair, base: SMCConfig | None = None, *, max_queue: int = 64, max_rows: int = 512
    ) -> None:
        if max_queue < 1 or max_rows < 1:
            raise ValueError("max_queue and max_rows must be at least 1")
        self.pair, self.base = pair, base or SMCConfig()
        self.max_queue, self.max_rows = max_queue, max_rows
        self.kernel = SMCSDKernel(pair.rows(), self.base, pair.eos_for(self.base), pair.decode)
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._running: list[Job] = []
        self._closing = self._cancel_all = False
        self._ids = itertools.count()
        self._counts = dict.fromkeys(("completed", "cancelled", "failed", "rejected"), 0)
        self._tokens = self._cycles = 0
        self._cycle_seconds = self._last_seconds = 0.0
        self._last_ess = math.nan
        self._rows_in_use = 0
        self._owner: int | None = None  # the thread holding ``exclusive``
        # The thread runs while there is work and ends after IDLE_SECONDS without: an idle
        # scheduler holds no thread, so nothing keeps a pair nobody uses alive.
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # Submitting.
    def submit(self, request: ServeRequest) -> Ticket:
        """Queue a request; its ticket at once (``QueueFull``, ``SchedulerClosed``, ``ValueError``)."""
        config = request.config
        if request.method == "ar":
            config = replace(config, n_particles=1, token_level=True)
        constraint = None
        if request.constraint is not None:
            constraint = request.constraint.build(self.pair.tokenizer, self.pair.eos_for(config))
        ids = [int(t) for t in request.prompt_ids]
        self.pair.check_request(ids, config)
        program = SMCSDModel(ids, constraint)
        return self.submit_program(program, config, seed=request_seed(config.seed, 0), stop=request.stop)

    def submit_program(
        self,
        program: SMCSDModel,
        config: SMCConfig,
        *,
        seed: int,
        stop: Sequence[str] = (),
        bounded: bool = True,
        on_progress: Callable[[int], None] | None = None,
    ) -> Ticket:
        """Queue a program with its settings and seed; its ticket.

        ``bounded=False`` (library calls) waits however long the queue; ``on_progress`` is
        called, on the scheduler's thread, with the request's longest output after each cycle.
        """
        if not self.shares(config):
            call = lambda: self._run_alone(program, config, seed, stop)  # noqa: E731
            return self._enqueue(program, config, seed, stop, alone=call, bounded=bounded)
        return self._enqueue(program, config, seed, stop, bounded=bounded, on_progress=on_progress)

    def shares(self, config: SMCConfig) -> bool:
        """Whether a request with ``config`` can join the batch (else it runs alone)."""
        return all(getattr(config, k) == getattr(self.base, k) for k in SHARED_SETTINGS)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Have the pair's rows to yourself while inside (other methods, custom loops).

        The batch running now finishes first; requests submitted meanwhile wait. Reentrant in
        the thread that holds it.
        """
        if self.held_here:
            yield
            return
        granted, released = threading.Event(), threading.Event()

        def hold() -> None:
            granted.set()
            released.wait()

        ticket = self._enqueue(None, self.base, 0, (), alone=hold, bounded=False)
        while not granted.wait(0.05):
            if ticket.done:  # the scheduler closed before our turn came
                ticket.wait()
                raise SchedulerClosed("the scheduler is closed")
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            self._owner = None
            released.set()
            ticket.wait()

    @property
    def held_here(self) -> bool:
        """Whether this thread holds ``exclusive`` (its calls then run directly, not batched)."""
        return self._owner == threading.get_ident()

    def _enqueue(self, program, config, seed, stop, *, alone=None, bounded=True, on_progress=None) -> Ticket:
        prompt = len(program.prompt) if program is not None and not isinstance(program.prompt, str) else 0
        ticket = Ticket(f"req-{next(self._ids)}", prompt, stop)
        rows = config.n_particles * (len(program.contexts()) if program is not None else 1)
        if rows > self.max_rows and alone is None:
            raise ValueError(f"the request needs {rows} rows (particles x contexts); at most {self.max_rows}")
        job = Job(ticket, program, config, seed, rows, alone, time.perf_counter(), on_progress)
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the scheduler is closed")
            if len(self._queue) >= self.max_queue and bounded:
                self._counts["rejected"] += 1
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); try again later")
            self._queue.append(job)
            self._cond.notify_all()
            if self._thread is None:
                serve = functools.partial(self._serve, torch.get_num_threads())
                self._thread = threading.Thread(target=serve, daemon=True, name="smcsd-scheduler")
                self._thread.start()
        return ticket

    # Reading.
    def stats(self) -> SchedulerStats:
        """What the scheduler holds and has done."""
        with self._cond:
            return SchedulerStats(
                len(self._queue),
                len(self._running),
                self._rows_in_use,
                self.max_rows,
                self.max_queue,
                dict(self._counts),
                self._tokens,
                self._cycles,
                self._cycle_seconds,
                self._last_seconds,
                self._last_ess,
            )

    def close(self, cancel: bool = False) -> None:
        """Take no more requests; finish (or cancel) those queued and running; stop the thread."""
        with self._cond:
            self._closing = True
            self._cancel_all = self._cancel_all or cancel
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and threading.current_thread() is not thread:
            thread.join()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(cancel=exc[0] is not None)

    # The scheduler's thread.
    def _serve(self, threads: int) -> None:
        # OpenMP's thread count is per thread, and a new one starts from the default: set the
        # caller's (through torch._C: vLLM's CPU worker makes torch.set_num_threads a no-op).
        torch._C.set_num_threads(threads)
        # Programs are coroutines: each cycle runs on this loop. Calls run alone run outside it
        # (they may start loops of their own).
        self._loop, state = asyncio.new_event_loop(), SMCState(())
        while True:
            jobs = self._admissible()
            if jobs is None:
                self._loop.close()
                return
            if jobs and jobs[0].alone is not None:
                self._alone(jobs[0])
                continue
            state = self._dropped(state)
            if jobs:
                state = self._admitted(state, jobs)
            if self._running:
                state = self._cycle(state)

    def _admissible(self) -> list[Job] | None:
        """The jobs to admit now, once there is work; None: the thread ends (closed, or idle)."""
        with self._cond:
            while True:
                if self._cancel_all:
                    for job in [*self._queue, *self._running]:
                        job.ticket.cancel()
                if self._closing and self._cancel_all:
                    while self._queue:
                        self._end(self._queue.popleft(), None)
                if self._running or self._queue:
                    break
                if self._closing or not self._cond.wait(IDLE_SECONDS) and not self._queue:
                    self._thread = None
                    return None
            jobs, rows = [], self._rows_in_use
            while self._queue:
                job = self._queue[0]
                if job.ticket.cancelled:
                    self._end(self._queue.popleft(), None)
                    continue
                if job.alone is not None:  # runs once the batch has drained
                    if not self._running and not jobs:
                        jobs.append(self._queue.popleft())
                    break
                if rows + job.rows > self.max_rows or self._needs_draft_later(job, rows):
                    break
                jobs.append(self._queue.popleft())
                rows += job.rows
            return jobs

    def _needs_draft_later(self, job: Job, rows: int) -> bool:
        """A drafting request waits for a batch whose rows the draft does not hold to drain."""
        store = self.kernel.store
        if rows == 0 or store.draft_ready or store.n_rows == 0 and not self._running:
            return False
        return self.kernel.needs_draft(job.program, job.config, self.pair.draft_record)

    def _alone(self, job: Job) -> None:
        try:
            out = job.alone()
        except BaseException as err:  # noqa: BLE001 - the caller gets it
            job.ticket.fail(err)
            self._count("failed")
            return
        if isinstance(out, tuple):  # an SMC request run alone: (generation, finish reason)
            job.ticket.finish(*out)
            self._count("completed", len(out[0].token_ids))
        else:
            job.ticket.finish(Generation("", [], "alone", None), "stop")

    def _run_alone(self, program: SMCSDModel, config: SMCConfig, seed: int, stop) -> tuple[Generation, str]:
        """A request whose shared settings differ from the scheduler's: a run of its own."""
        kernel = SMCSDKernel(self.pair.rows(), config, self.pair.eos_for(config), self.pair.decode)
        start = time.perf_counter()
        state = kernel.admit(
            SMCState(()), [program], self.pair.draft_record, self.pair.encode, [config], [seed]
        )
        while not state.done:
            state, _ = self._loop.run_until_complete(kernel.step(state))
        return generation_of(kernel, self.pair.draft_record, state.populations[0], start, stop)

    def _dropped(self, state: SMCState) -> SMCState:
        """The state without cancelled requests (their rows freed)."""
        keep = [not job.ticket.cancelled for job in self._running]
        if all(keep):
            return state
        for job, k in zip(self._running, keep):
            if not k:
                self._end(job, None)
        state = replace(
            state, populations=tuple(self.kernel.pack([p for p, k in zip(state.populations, keep) if k]))
        )
        with self._cond:
            self._running = [j for j, k in zip(self._running, keep) if k]
            self._rows_in_use = rows_in_use(state)
        return state

    def _admitted(self, state: SMCState, jobs: list[Job]) -> SMCState:
        """The state with ``jobs`` admitted (a failure fails those jobs only)."""
        try:
            state = self.kernel.admit(
                state,
                [j.program for j in jobs],
                self.pair.draft_record,
                self.pair.encode,
                [j.config for j in jobs],
                [j.seed for j in jobs],
            )
        except Exception as err:  # noqa: BLE001 - those callers get it
            for job in jobs:
                job.ticket.fail(err)
                self._count("failed")
            return state
        with self._cond:
            self._running += jobs
            self._rows_in_use = rows_in_use(state)
        return state

    def _cycle(self, state: SMCState) -> SMCState:
        """One step of every running request; stop strings end particles; the finished leave."""
        start = time.perf_counter()
        try:
            state, info = self._loop.run_until_complete(self.kernel.step(state))
        except Exception as err:  # noqa: BLE001 - a failed step fails every request in it
            for job in self._running:
                job.ticket.fail(err)
                self._count("failed")
            with self._cond:
                self._running, self._rows_in_use = [], 0
            return SMCState(())
        state = self._stopped(state)
        for job, pop in zip(self._running, state.populations):
            job.ticket.offer(self.pair.decode(settled_tokens(pop)))
            if job.on_progress is not None:
                job.on_progress(max(len(p.token_ids) for p in pop.particles))
        done = [not pop.stepping for pop in state.populations]
        for job, pop, d in zip(self._running, state.populations, done):
            if d:
                gen, reason = generation_of(
                    self.kernel, self.pair.draft_record, pop, job.start, job.ticket.stop
                )
                job.ticket.finish(gen, reason)
                self._count("completed", len(gen.token_ids))
        ess = [e / len(p.particles) for e, p in zip(info.ess, state.populations) if p.stepping and e]
        with self._cond:
            self._running = [j for j, d in zip(self._running, done) if not d]
            self._rows_in_use = rows_in_use(state)
            self._cycles += 1
            self._last_seconds = time.perf_counter() - start
            self._cycle_seconds += self._last_seconds
            self._last_ess = sum(ess) / len(ess) if ess else math.nan
        return replace(state, populations=tuple(p for p, d in zip(state.populations, done) if not d))

    def _stopped(self, state: SMCState) -> SMCState:
        """End every particle whose text holds one of its request's stop strings."""
        pops, changed = [], False
        for job, pop in zip(self._running, state.populations):
            ended = stopped_at(pop, job.ticket.stop)
            changed |= ended is not pop
            pops.append(ended)
        return replace(state, populations=tuple(self.kernel.pack(pops))) if changed else state

    def _end(self, job: Job, err: BaseException | None) -> None:
        """A job leaves unfinished: cancelled, or failed with ``err``."""
        job.ticket.fail(err or RequestCancelled(f"request {job.ticket.id} was cancelled"))
        self._count("failed" if err else "cancelled")

    def _count(self, outcome: str, tokens: int = 0) -> None:
        with self._cond:
            self._counts[outcome] += 1
            self._tokens += tokens

"""The engine core: one pair's requests, advanced one cycle per ``step``, on whichever thread drives it.

A step is: ``schedule`` what runs (a pure decision), apply it (cancelled requests leave,
waiting ones are prefilled into the batch, or a call runs alone), one SMC-SD step of every
running request (one fused target forward), then ``update_from_output``: stop strings end
particles, each request's newly settled token ids go out, finished requests leave with their
result. Text is the client's: its ``Ticket`` decodes the ids it is sent and cuts at stop strings.
Every population carries its request's id, so requests are found by id, never by position.
The core is driven by its ``Engine`` (``engine.client``): on the torch thread, on a thread
taking the engine's turns itself (``Engine.run`` from inside a call), or in an engine process
(``engine.process``); it never starts a thread.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..backends.base import NonFiniteLogits
from ..config import SMCConfig
from ..ends import FinishReason
from ..inference.outcome import result_of
from ..inference.state import Population, SMCState, settled_tokens
from ..inference.step import Admission, SMCSDKernel
from ..results import generation
from .pair import PairCore
from .request import Call, Request, RequestStatus, Work, finish, shared_key
from .scheduling import Capacity, Plan, schedule
from .scoring import scored
from .stops import stopped_at


class RequestCancelled(RuntimeError):
    """The request was cancelled (by its caller, or by a closing engine) before it finished."""


@dataclass(frozen=True)
class Output:
    """What the engine tells of one request after a step.

    Attributes:
        id: the request's (or call's) id.
        settled_ids: the token ids every surviving particle came to share since the last output
            (a stream shows their text; the shared prefix only grows).
        result: once finished: the request's ``Generation``, or the call's return value.
        reason: why it finished (None while it runs, and for calls).
        error: why it failed, or ``RequestCancelled``.
        population: a finished request's final population (in-process callers read its particles).
        finished: this is its last output: it finished, failed or was cancelled (set by whoever
            ends it: a call may return None, so no other field can tell).
    """

    id: str
    settled_ids: tuple[int, ...] = ()
    result: object = None
    reason: FinishReason | None = None
    error: BaseException | None = None
    population: Population | None = None
    finished: bool = False


@dataclass(frozen=True)
class CoreStats:
    """What the core holds and has done (a snapshot, safe to read from any thread)."""

    waiting: int = 0
    running: int = 0
    rows_in_use: int = 0
    counts: tuple[tuple[str, int], ...] = (("completed", 0), ("cancelled", 0), ("failed", 0))
    tokens: int = 0
    cycles: int = 0
    cycle_seconds: float = 0.0
    last_seconds: float = 0.0
    last_ess: float = math.nan
    kv_bytes: int = 0  # what both backends' KV caches hold now


class EngineCore:
    """One pair's batch of SMC-SD requests, and the calls that need its rows alone.

    Args:
        pair: the pair (its one row store becomes the batch's).
        base: the settings of the batch every request sharing them joins (``SHARED_SETTINGS``).
        max_rows: rows the running requests may hold in all.
        keep_draft: every batch holds the draft's rows, so that a request that drafts joins a
            batch begun by requests that do not (a server's, whose requests arrive one by one);
            otherwise such a batch leaves the draft out and a drafting request waits for it to end.
    """

    def __init__(
        self, pair: PairCore, base: SMCConfig | None = None, *, max_rows: int = 512, keep_draft: bool = False
    ) -> None:
        if max_rows < 1:
            raise ValueError("max_rows must be at least 1")
        self.pair, self.base, self.max_rows = pair, base or SMCConfig(), max_rows
        self.keep_draft = keep_draft
        self.waiting: deque[Work] = deque()
        self.running: list[Request] = []  # in the batch's order
        self.state = SMCState(())
        self.kernel = self._kernel(self.base)
        self.stats = CoreStats()
        self._told: dict[str, int] = {}  # each running request's settled tokens, as many as told
        self._records: dict[str, object] = {}  # each request's draft record, fixed at admission
        self.in_cycle = False  # a cycle runs (its observers and reshapes run inside it)
        self._loop: asyncio.AbstractEventLoop | None = None

    # Taking work.
    def add(self, work: Work, *, first: bool = False) -> None:
        """Queue a request or a call (it runs at a later boundary); ``first``: ahead of all waiting."""
        if isinstance(work, Request):
            kernel = self._kernel(work.config)
            work.drafts = kernel.needs_draft(work.program, work.config, work.record or self.pair.draft_record)
        if first:
            self.waiting.appendleft(work)
        else:
            self.waiting.append(work)
        self._publish()

    def abort(self, work_id: str) -> None:
        """Cancel a request or call: it leaves (or never runs) at the next boundary."""
        for work in (*self.waiting, *self.running):
            if work.id == work_id:
                work.cancelled = True

    @property
    def has_work(self) -> bool:
        """Something waits or runs."""
        return bool(self.waiting or self.running)

    # Stepping.
    def step(self) -> list[Output]:
        """One boundary and one cycle (calls run here, outside any event loop)."""
        outputs = self._boundary()
        if self.running:
            self._loop = self._loop or _cycle_loop()
            try:
                outputs += self._loop.run_until_complete(self._cycle())
            except BaseException:  # a Ctrl-C mid-cycle: the loop stops where it was
                _abandon(self._loop)
                self._loop = None
                raise
        return self._rested(outputs)

    async def astep(self) -> list[Output]:
        """``step`` from a running event loop (a call must then not start a loop of its own)."""
        outputs = self._boundary()
        if self.running:
            outputs += await self._cycle()
        return self._rested(outputs)

    def _rested(self, outputs: list[Output]) -> list[Output]:
        """``outputs``, after freeing the rows once nothing waits or runs.

        A new batch prefills into fresh caches, so rows kept past the last request would hold
        their memory for nothing (a burst's hundreds of MB, on a server that then sits idle).
        """
        if not self.has_work and not self.state.populations and self.pair.store.release():
            self._publish()
        return outputs

    def close(self) -> None:
        """Release the core's event loop."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # A boundary: the plan, applied.
    def _boundary(self) -> list[Output]:
        capacity = Capacity(self.max_rows, self.pair.store.draft_ready)
        plan = schedule(self.waiting, self.running, capacity)
        outputs = self._apply(plan)
        self._publish()
        return outputs

    def _apply(self, plan: Plan) -> list[Output]:
        for work in plan.passed:
            work.passed += 1
        leaving = {w.id for w in (*plan.cancel, *plan.admit)} | ({plan.call.id} if plan.call else set())
        self.waiting = deque(w for w in self.waiting if w.id not in leaving)
        self._publish()  # a call may run long: it no longer waits
        outputs = [self._ended(w, FinishReason.CANCELLED) for w in plan.cancel]
        if plan.drop:
            outputs += self._drop(plan.drop)
        if plan.call is not None:
            outputs.append(self._run(plan.call))
        if plan.admit:
            outputs += self._admit(plan.admit)
        return outputs

    def _drop(self, requests: Sequence[Request]) -> list[Output]:
        """Cancelled running requests leave with what every surviving particle already shares."""
        gone = {r.id: r for r in requests}
        outputs = [
            self._cut(gone[pop.request_id], pop) for pop in self.state.populations if pop.request_id in gone
        ]
        kept = [pop for pop in self.state.populations if pop.request_id not in gone]
        self.state = replace(self.state, populations=tuple(self.kernel.pack(kept)))
        self.running = [r for r in self.running if r.id not in gone]
        return outputs

    def _cut(self, request: Request, pop: Population) -> Output:
        """A cancelled request's ``Generation``: its settled tokens (what it streamed), ``cancelled``."""
        ids = list(settled_tokens(pop))
        text = self.pair.decode(ids)
        stats = request.cost(pop, len(ids), self._forward_seconds())
        gen = generation("smcsd", text, ids, stats, FinishReason.CANCELLED, "cancelled before it finished")
        out = self._ended(request, FinishReason.CANCELLED)
        return replace(out, result=gen, error=None)

    def _run(self, call: Call) -> Output:
        try:
            value = call.fn()
        except BaseException as err:  # noqa: BLE001 - its caller gets it
            finish(call, FinishReason.ERROR)
            return Output(call.id, error=err, finished=True)
        finish(call, FinishReason.STOP)
        return Output(call.id, result=value, finished=True)

    def _admit(self, requests: Sequence[Request]) -> list[Output]:
        if not self.running:  # a new batch: its kernel runs its settings
            self.kernel = self._kernel(requests[0].config)
        joining = [Admission(r.program, r.config, r.seed, r.id, r.record) for r in requests]
        clock = self._forward_seconds()  # its prefill is its own: counted from here
        try:
            record, encode = self.pair.draft_record, self.pair.encode
            self.state = self.kernel.admit(self.state, joining, record, encode, draft=self.keep_draft)
        except Exception as err:  # noqa: BLE001 - those requests fail, the batch goes on
            return [self._ended(r, FinishReason.ERROR, err) for r in requests]
        for r in requests:
            r.status, r.forwards_from = RequestStatus.RUNNING, clock
            self._records[r.id] = r.record or self.pair.draft_record
        self.running += requests
        return []

    def _forward_seconds(self) -> tuple[float, float]:
        """The target's and the draft's forward time so far (on CUDA, a wait for their events)."""
        return self.pair.target_lm.stats.seconds, self.pair.draft_lm.stats.seconds

    def _kernel(self, config: SMCConfig) -> SMCSDKernel:
        """The kernel of a batch of ``config``'s shared settings (the base's own, when it shares them)."""
        c = self.base if shared_key(config) == shared_key(self.base) else config
        # The model's EOS ids: each request ends at them unless it ignores EOS (``SMCSDKernel.eos_of``).
        return SMCSDKernel(
            self.pair.store, c, self.pair.eos_token_ids, self.pair.decode, self.pair.conditions
        )

    # A cycle, and what it tells.
    async def _cycle(self) -> list[Output]:
        self.in_cycle = True
        try:
            return await self._stepped()
        finally:
            self.in_cycle = False

    async def _stepped(self) -> list[Output]:
        start = time.perf_counter()
        by_id = {r.id: r for r in self.running}
        try:
            self._reshaped(by_id, "before")
            self.state, info = await self.kernel.step(self.state)
            self._reshaped(by_id, "after")
        except Exception as err:  # noqa: BLE001 - a failed step fails every request in it
            failed = [self._ended(r, FinishReason.ERROR, err) for r in self.running]
            self.running, self.state = [], SMCState(())
            return failed
        self._stop_strings(by_id)
        info = replace(info, populations=self.state.populations)
        outputs = self.update_from_output(by_id, info)
        self._count_cycle(time.perf_counter() - start, info)
        return outputs

    def _reshaped(self, by_id: dict[str, Request], which: str) -> None:
        """Apply each request's ``reshape`` to its population, then give the rows their new order."""
        if not any(r.reshape for r in by_id.values()):
            return
        pops = []
        for pop in self.state.populations:
            shape = by_id[pop.request_id].reshape
            pops.append(getattr(shape, which)(pop) if shape else pop)
        self.state = replace(self.state, populations=tuple(self.kernel.pack(pops)))

    def _stop_strings(self, by_id: dict[str, Request]) -> None:
        """End every particle whose text holds one of its request's stop strings."""
        pops = [stopped_at(pop, by_id[pop.request_id].stop) for pop in self.state.populations]
        if any(new is not old for new, old in zip(pops, self.state.populations)):
            self.state = replace(self.state, populations=tuple(self.kernel.pack(pops)))

    def update_from_output(self, by_id: dict[str, Request], info) -> list[Output]:
        """After a cycle: observers see it, settled text goes out, finished requests leave."""
        order = {pop.request_id: i for i, pop in enumerate(self.state.populations)}
        observers: dict[int, tuple] = {}
        for r in self.running:
            if r.observer is not None:
                observers.setdefault(id(r.observer), (r.observer, []))[1].append(order[r.id])
        for observer, indices in observers.values():
            observer(info.narrowed(indices))
        outputs, staying = [], []
        for pop in self.state.populations:
            request = by_id[pop.request_id]
            if pop.fault:  # the engine failed this request alone: its batch-mates go on
                outputs.append(self._ended(request, FinishReason.ERROR, NonFiniteLogits(pop.fault)))
            elif pop.stepping:
                staying.append(pop)
                settled, told = settled_tokens(pop), self._told.get(request.id, 0)
                if len(settled) > told:
                    outputs.append(Output(request.id, settled_ids=settled[told:]))
                    self._told[request.id] = len(settled)
            else:
                outputs.append(self._finished(request, pop))
        self.state = replace(self.state, populations=tuple(staying))
        live = {pop.request_id for pop in staying}
        self.running = [r for r in self.running if r.id in live]
        return outputs

    def _finished(self, request: Request, pop: Population) -> Output:
        """A finished request's ``Generation`` and cost (its text whole: the ticket cuts at a stop string)."""
        gen = result_of(pop, self.kernel, self._records.pop(request.id, self.pair.draft_record))
        reason = FinishReason(gen.finish_reason)
        gen = replace(gen, stats=request.cost(pop, len(gen.token_ids), self._forward_seconds()))
        if request.logprobs is not None or request.prompt_logprobs is not None:
            gen = scored(
                self.pair.target.model,
                request.program.prompt,
                gen,
                temperature=request.config.target_temperature,
                top=request.logprobs,
                prompt_top=request.prompt_logprobs,
            )
        finish(request, reason)
        self._told.pop(request.id, None)
        self._count("completed", len(gen.token_ids))
        return Output(request.id, result=gen, reason=reason, population=pop, finished=True)

    def _ended(self, work: Work, reason: FinishReason, err: BaseException | None = None) -> Output:
        """A request or call that leaves unfinished: cancelled (never run), or failed with ``err``."""
        finish(work, reason)
        self._told.pop(work.id, None)
        self._records.pop(work.id, None)
        if isinstance(work, Request):
            self._count("failed" if err else "cancelled")
        err = err or RequestCancelled(f"request {work.id} was cancelled")
        return Output(work.id, reason=reason, error=err, finished=True)

    # Counting.
    def _count(self, outcome: str, tokens: int = 0) -> None:
        counts = dict(self.stats.counts)
        counts[outcome] += 1
        self.stats = replace(self.stats, counts=tuple(counts.items()), tokens=self.stats.tokens + tokens)

    def _count_cycle(self, seconds: float, info) -> None:
        ess = [e / len(p.particles) for e, p in zip(info.ess, info.populations) if p.stepping and e]
        s = self.stats
        self.stats = replace(
            s,
            cycles=s.cycles + 1,
            cycle_seconds=s.cycle_seconds + seconds,
            last_seconds=seconds,
            last_ess=sum(ess) / len(ess) if ess else math.nan,
        )
        self._publish()

    def _publish(self) -> None:
        rows = sum(r >= 0 for pop in self.state.populations for rows in pop.rows for r in rows)
        kv = sum(getattr(lm, "cache_bytes", 0) for lm in (self.pair.target_lm, self.pair.draft_lm))
        counts = dict(waiting=len(self.waiting), running=len(self.running), rows_in_use=rows, kv_bytes=kv)
        self.stats = replace(self.stats, **counts)


def _cycle_loop() -> asyncio.AbstractEventLoop:
    """An event loop for ``step``'s cycles, where an interrupt is not reported a second time.

    A Ctrl-C (or a closing process's ``KeyboardInterrupt``) raised inside a particle's task ends
    that task with it and leaves the loop at once, before the task is read; when the task is
    collected, asyncio would log it as "Task exception was never retrieved", a traceback after
    the command has already said it was interrupted.
    """
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(_unless_interrupted)
    return loop


def _abandon(loop: asyncio.AbstractEventLoop) -> None:
    """Close a loop left mid-cycle, and the tasks in it that never started (no code of theirs runs)."""
    for task in asyncio.all_tasks(loop):
        if inspect.getcoroutinestate(task.get_coro()) == inspect.CORO_CREATED:
            task.get_coro().close()
    loop.close()


def _unless_interrupted(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    if not isinstance(context.get("exception"), (KeyboardInterrupt, SystemExit)):
        loop.default_exception_handler(context)

"""The engine in this process: callers on any thread submit requests and calls; the torch thread runs them.

Callers get a ``Ticket`` per request (or the call's result); their messages (add, abort)
wait in an inbox drained at each of the engine's turns, so one thread at a time touches the
core: the torch thread, or the thread inside a call that takes the engine's turns itself
(``Engine.run``). Who may come in is the ``gate``'s to say.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from ..config import DraftRecord, SMCConfig
from ..inference.program import SMCSDModel
from ..inference.rows import RowStore
from ..inference.step import request_seed
from ..potentials.spec import ConstraintSpec
from .core import EngineCore, Output, RequestCancelled
from .gate import EngineClosed, EngineStats, Gate, QueueFull
from .pair import PairCore
from .request import Call, Request, Reshape, Work
from .scoring import MAX_TOP_LOGPROBS
from .ticket import Ticket
from .worker import torch_thread

SERVE_METHODS = ("smcsd", "ar")  # ar: one particle, the target alone (the same kernel, drafting nothing)


@dataclass(frozen=True)
class ServeRequest:
    """One request by value, as a server or a batch file gives it.

    Attributes:
        prompt_ids: the prompt's token ids (any chat template already applied).
        config: its settings (seed, budget, temperatures, N, K, ...).
        method: one of ``SERVE_METHODS``.
        constraint: a JSON Schema, regex or grammar every output must satisfy, or None.
        stop: stop strings: the output ends before the first one.
        logprobs: give the target's log-probabilities of the output's tokens, with this many
            likeliest alternatives at each (0 to 20); None: none.
        prompt_logprobs: the same for the prompt's tokens (the first has none); None: none.
    """

    prompt_ids: list[int]
    config: SMCConfig = field(default_factory=SMCConfig)
    method: str = "smcsd"
    constraint: ConstraintSpec | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SERVE_METHODS:
            raise ValueError(
                f"unknown method {self.method!r} for serving; choose from {', '.join(SERVE_METHODS)}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty texts")
        for top in (self.logprobs, self.prompt_logprobs):
            if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise ValueError(f"top log-probabilities must be from 0 to {MAX_TOP_LOGPROBS}, got {top}")

    @property
    def settings(self) -> SMCConfig:
        """The settings it runs with (``ar``: one particle at token level)."""
        if self.method == "ar":
            return replace(self.config, n_particles=1, token_level=True)
        return self.config


def check_served(pair, request: ServeRequest) -> list[int]:
    """Refuse (``ValueError``) a request its pair cannot run; its prompt ids.

    The constraint's text was checked when its ``ConstraintSpec`` was made; it is compiled for
    the tokenizer once, where the request runs (``program_of``).
    """
    ids = [int(t) for t in request.prompt_ids]
    pair.check_request(ids, request.settings)
    if (request.logprobs is not None or request.prompt_logprobs is not None) and not pair.facts.scores:
        raise ValueError("logprobs need the target as a PyTorch model (the hf backend)")
    return ids


def program_of(pair: PairCore, request: ServeRequest) -> SMCSDModel:
    """The plain program of a request, its constraint built for the pair (``ValueError``: refused)."""
    ids = check_served(pair, request)
    constraint = None
    if request.constraint is not None:
        constraint = request.constraint.build(pair.tokenizer, pair.eos_for(request.settings))
    return SMCSDModel(ids, constraint)


class Engine:
    """One pair's requests and calls, run by one ``EngineCore`` on the process's torch thread.

    Args:
        pair: the pair core.
        base: the settings of the batch requests join (``SHARED_SETTINGS``) and their defaults.
        max_queue: requests that may wait beyond the rows; more raise ``QueueFull``.
        max_rows: rows (particles times contexts) the running requests may hold.
        keep_draft: every batch holds the draft's rows (``EngineCore``; a server's engine).
    """

    def __init__(
        self,
        pair: PairCore,
        base: SMCConfig | None = None,
        *,
        max_queue: int = 64,
        max_rows: int = 512,
        keep_draft: bool = False,
    ) -> None:
        max_rows = min(max_rows, pair.row_limit or max_rows)  # fixed shapes hold so many rows
        self.gate = Gate(max_queue, max_rows)
        self.pair, self.max_queue, self.max_rows = pair, max_queue, max_rows
        self.core = EngineCore(pair, base, max_rows=max_rows, keep_draft=keep_draft)
        self.base = self.core.base
        self.threads = torch.get_num_threads()  # the creator's: its turns run with as many
        self._inbox: deque[tuple[str, object]] = deque()
        self._owner: int | None = None  # the thread holding ``exclusive``
        self._thread = torch_thread()
        self._thread.attach(self)

    @classmethod
    def over(
        cls, store: RowStore, eos: Sequence[int], *, decode: Callable | None = None, max_rows: int = 1 << 20
    ) -> Engine:
        """An engine over a row store of one's own (a test's, a mock run's).

        ``decode``: ids as text by default. Its row limit is high by default: a pool of requests
        over mock models runs as one batch.
        """
        pair = PairCore.over(store, eos, decode=decode or (lambda ids: " ".join(map(str, ids))))
        return cls(pair, max_rows=max_rows)

    @property
    def busy(self) -> bool:
        """Some request or call is still in (waiting or running)."""
        with self.gate.lock:
            return bool(self.gate.live)

    # What a server reads of the pair.
    @property
    def tokenizer(self):
        """The pair's tokenizer (a server encodes its prompts with it)."""
        return self.pair.tokenizer

    @property
    def chat(self) -> bool:
        """Whether text prompts get the chat template."""
        return self.pair.chat

    @property
    def names(self) -> dict:
        """The models' names and the backend."""
        return self.pair.names

    # Submitting.
    def submit(self, request: ServeRequest) -> Ticket:
        """Queue a request; its ticket at once (``QueueFull``, ``EngineClosed``, ``ValueError``)."""
        program = program_of(self.pair, request)
        config = request.settings
        seed = request_seed(config.seed, 0)
        scores = dict(logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs)
        queued = Request(program, config, seed, request.stop, arrival=time.perf_counter(), **scores)
        ticket = self._ticket(queued)
        self._enqueue([queued], [ticket])
        return ticket

    def submit_program(
        self,
        program: SMCSDModel,
        config: SMCConfig,
        *,
        seed: int,
        stop: Sequence[str] = (),
        bounded: bool = True,
        observer: Callable | None = None,
        on_done: Callable[[Ticket], None] | None = None,
        logprobs: int | None = None,
    ) -> Ticket:
        """Queue a program with its settings and seed; its ticket.

        ``bounded=False`` (library calls) waits however long the queue; ``observer`` is
        called on the torch thread after each of the request's cycles (a narrowed ``StepInfo``);
        ``on_done`` with the ticket once it is done (on the thread that finished it);
        ``logprobs``: as ``ServeRequest``'s.
        """
        arrival = time.perf_counter()
        request = Request(program, config, seed, tuple(stop), bounded, observer, arrival, logprobs=logprobs)
        ticket = self._ticket(request, on_done)
        self._enqueue([request], [ticket])
        return ticket

    def run(
        self,
        programs: Sequence[SMCSDModel],
        config: SMCConfig,
        *,
        observer: Callable | None = None,
        reshape: Reshape | None = None,
        record: DraftRecord | None = None,
    ) -> list[Ticket]:
        """Run ``programs`` as requests of the batch, request i seeded ``request_seed(config.seed, i)``.

        Returns their tickets, done (the first failure is raised). ``observer`` and ``reshape``
        as ``Request``'s; ``record``: the draft record they start from (None: the pair's). From
        the torch thread (inside a call) or the thread holding ``exclusive``, where the engine's
        own turns cannot come, this thread takes them until these requests are done.
        """
        arrival = time.perf_counter()
        requests = [
            Request(
                p, config, request_seed(config.seed, i), (), False, observer, arrival, reshape, record=record
            )
            for i, p in enumerate(programs)
        ]
        here = self._thread.here or self._owner == threading.get_ident()
        if here and self.core.in_cycle:
            raise RuntimeError("SMC-SD cannot run from inside a cycle (an observer or a reshape)")
        tickets = [self._ticket(r) for r in requests]
        if not here:
            self._enqueue(requests, tickets)  # one message: one turn admits them together
        else:  # a call's own requests run first (the rows are the call's), this thread stepping them
            self._enter(requests, tickets)
            for r in reversed(requests):
                self.core.add(r, first=True)
            while not all(t.done for t in tickets):
                self._take_turn()
        for t in tickets:
            t.wait()
        return tickets

    def _ticket(self, request: Request, on_done: Callable[[Ticket], None] | None = None) -> Ticket:
        prompt = request.program.prompt
        tokens = 0 if isinstance(prompt, str) or prompt is None else len(prompt)
        return Ticket(request.id, tokens, request.stop, self.abort, on_done, self.pair.decode_bytes)

    def _take_turn(self) -> None:
        """One turn on the calling thread; if it raises, what the engine holds fails (as on its thread)."""
        try:
            self.turn()
        except Exception as err:  # noqa: BLE001 - every request in gets it
            self.crashed(err)

    def call(self, fn: Callable[[], object]) -> object:
        """``fn()`` on the torch thread once the batch has drained, with the pair's rows to itself.

        On the torch thread itself, or in the thread holding ``exclusive``, it runs at once; from
        inside a cycle (an observer, a reshape) it is refused: its work would move the rows the
        cycle holds.
        """
        if self._thread.here or self._owner == threading.get_ident():
            if self.core.in_cycle:
                raise RuntimeError("a call cannot run from inside a cycle (an observer or a reshape)")
            return fn()
        future: Future = Future()
        self._enqueue([Call(fn)], [future])
        return future.result()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Have the pair's rows to yourself while inside (custom loops on this thread).

        The batch running now finishes first; requests submitted meanwhile wait. Prefer
        ``call``, which runs the work on the torch thread.
        """
        if self._owner == threading.get_ident() or self._thread.here:
            yield
            return
        granted, released = threading.Event(), threading.Event()

        def hold() -> None:
            granted.set()
            released.wait()

        future: Future = Future()
        self._enqueue([Call(hold)], [future])
        while not granted.wait(0.05):
            if future.done():  # the engine closed before our turn came
                future.result()
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            self._owner = None
            released.set()
            future.result()

    def abort(self, work_id: str) -> None:
        """Cancel a request: it leaves at the next boundary (nothing if it is done)."""
        self._inbox.append(("abort", work_id))
        self._thread.wake()

    def _enqueue(self, works: Sequence[Work], handles: Sequence[Ticket | Future]) -> None:
        """Let ``works`` in with their callers' handles, as one message (a turn takes them all)."""
        self._enter(works, handles)
        self.threads = torch.get_num_threads()  # the latest caller's count
        self._inbox.append(("add", tuple(works)))
        self._thread.wake()

    def _enter(self, works: Sequence[Work], handles: Sequence[Ticket | Future]) -> None:
        """The gate lets all of ``works`` in, or none."""
        entered = []
        try:
            for work, handle in zip(works, handles):
                self.gate.enter(work.id, handle, work.rows, work.bounded)
                entered.append(work.id)
        except BaseException:
            for work_id in entered:  # all or none
                self.gate.handle(work_id, done=True)
            raise

    # The torch thread's side.
    @property
    def ready(self) -> bool:
        """The core has work, or a message waits."""
        return bool(self._inbox) or self.core.has_work

    def turn(self) -> None:
        """Take the messages, run one step, hand out what it tells."""
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                for work in item:
                    self.core.add(work)
            else:
                self.core.abort(item)
        if self.core.has_work:
            self._deliver(self.core.step())

    def crashed(self, err: BaseException) -> None:
        """A turn raised: every request and call it holds fails with ``err``; the core starts empty."""
        with self.gate.lock:
            live = list(self.gate.live)
        self.core.close()
        self.core = EngineCore(self.pair, self.base, max_rows=self.max_rows, keep_draft=self.core.keep_draft)
        self._deliver([Output(work_id, error=err, finished=True) for work_id in live])

    def _deliver(self, outputs: list[Output]) -> None:
        for out in outputs:
            handle = self.gate.handle(out.id, out.finished)
            if isinstance(handle, Ticket):
                handle.apply(out)
            elif handle is not None and out.error is not None:
                handle.set_exception(out.error)
            elif handle is not None:
                handle.set_result(out.result)

    # Reading and closing.
    def stats(self) -> EngineStats:
        """What the engine holds and has done."""
        arriving = sum(len(item) for kind, item in list(self._inbox) if kind == "add")
        return self.gate.stats(self.core.stats, self.core.stats.waiting + arriving, self.pair.facts)

    def close(self, cancel: bool = False) -> None:
        """Take no more requests; finish (or cancel) those queued and running, then return."""
        live = self.gate.close()
        if cancel:
            for work_id, _ in live:
                self.abort(work_id)
        if self._thread.here or self._owner == threading.get_ident():
            return  # its own work cannot finish while it waits here
        for _, handle in live:
            with contextlib.suppress(BaseException):
                handle.wait() if isinstance(handle, Ticket) else handle.exception()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(cancel=exc[0] is not None)


__all__ = [
    "SERVE_METHODS",
    "Engine",
    "Gate",
    "EngineClosed",
    "EngineStats",
    "QueueFull",
    "RequestCancelled",
    "ServeRequest",
    "program_of",
]

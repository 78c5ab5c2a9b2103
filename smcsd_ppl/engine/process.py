"""The engine in a process of its own: the server keeps HTTP, tokenizing and streaming; the child the cycles.

One interpreter lock each: the server's event loop never waits on the engine's Python work,
nor the engine on the server's. The child loads the pair (its ``spec``), then loops: take
the messages that arrived (add, abort, close), run one step, send what it told (each
request's settled text, results, failures) with the engine's counters. The parent checks each
request against the pair's facts (vocabulary, context, KV budget, constraint) before it
sends it, so a refusal is immediate; its reader thread hands the child's outputs to tickets.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, replace

from ..backends.fixed import FixedShape
from ..config import SMCConfig
from ..inference.step import request_seed
from ..text import token_text
from .client import ServeRequest, check_served, program_of
from .core import CoreStats, EngineCore, Output, RequestCancelled
from .gate import EngineStats, Gate
from .pair import PairFacts
from .request import Request, new_id
from .ticket import Ticket
from .worker import torch_thread

DEFAULT_HANG_SECONDS = 300.0  # a cycle this long with requests in is a hang (a long CPU prefill: a minute)
HEARTBEAT_SECONDS = 1.0  # a working child sends its counters at least this often, outputs or not


@dataclass
class RemotePair:
    """What the server process holds of the pair: its tokenizer, names and facts (no model)."""

    tokenizer: object
    chat: bool
    names: dict
    facts: PairFacts

    @property
    def eos_token_ids(self) -> list[int]:
        """The target's EOS ids."""
        return list(self.facts.eos_token_ids)

    def eos_for(self, config: SMCConfig) -> list[int]:
        """EOS ids in force under ``config``."""
        return [] if config.ignore_eos else self.eos_token_ids

    def check_request(self, ids, config: SMCConfig) -> None:
        """Refuse a request's prompt that is empty, off the vocabulary or too long, in one line."""
        self.facts.check_request(ids, config)

    def decode_bytes(self, ids) -> str:
        """The text of token ids the engine sends (its tickets decode it here, as the pair does there)."""
        return token_text(self.tokenizer, ids)


class EngineProcess:
    """An engine running in a child process, with ``Engine``'s interface (submit, stats, close).

    Args:
        spec: how the child loads the pair: a picklable object whose ``load()`` returns an
            ``SMCSD`` (``serving.settings.PairSpec``).
        base: the settings of the batch requests join, and their defaults.
        max_queue: requests that may wait beyond the rows; more raise ``QueueFull``.
        max_rows: rows (particles times contexts) the running requests may hold.
        hang_seconds: with work in, no word from the child for this long (no cycle ended) means
            it hangs: it is killed and treated as dead; 0: wait forever.
    """

    def __init__(
        self,
        spec,
        base: SMCConfig | None = None,
        *,
        max_queue: int = 64,
        max_rows: int = 512,
        hang_seconds: float = DEFAULT_HANG_SECONDS,
    ) -> None:
        if getattr(spec, "deterministic", False):  # fixed shapes hold so many rows
            max_rows = min(max_rows, FixedShape().rows)
        self.gate = Gate(max_queue, max_rows)
        self.base, self.max_queue, self.max_rows = base or SMCConfig(), max_queue, max_rows
        context = multiprocessing.get_context("spawn")  # a fork would copy OpenMP's state
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_engine_main, args=(child, spec, self.base, max_rows), daemon=True, name="smcsd-engine"
        )
        self._process.start()
        child.close()
        kind, hello = self._conn.recv()
        if kind == "error":
            self._process.join()
            raise hello
        for category, message in hello.pop("notes"):  # what loading warned of, said here
            warnings.warn(message, category, stacklevel=2)
        self.pair = RemotePair(**hello)
        self._send_lock = threading.Lock()
        self._stats = CoreStats()
        self.died = threading.Event()  # the child ended without being told to (killed, crashed)
        self.hang_seconds, self._hung, self._heard = hang_seconds, False, time.monotonic()
        self.reader_failure = ""  # why the thread reading the child's outputs failed, if it did
        if hang_seconds > 0:
            threading.Thread(target=self._watch, daemon=True, name="smcsd-engine-watch").start()
        self._reader = threading.Thread(target=self._read, daemon=True, name="smcsd-engine-reader")
        self._reader.start()

    @property
    def busy(self) -> bool:
        """Some request or call is still in (waiting or running)."""
        with self.gate.lock:
            return bool(self.gate.live)

    @property
    def alive(self) -> bool:
        """The child runs, or was told to close (False: it ended on its own: killed, out of memory)."""
        return not self.died.is_set()

    @property
    def exit_note(self) -> str:
        """How the child ended, in a few words (its exit code, the signal that killed it, a hang)."""
        code = self._process.exitcode
        if self.reader_failure:
            return f"the server's reader of its outputs failed ({self.reader_failure}): stopped"
        if self._hung:
            return f"no cycle ended in {self.hang_seconds:g} s with requests in: killed as hung"
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _watch(self) -> None:
        """Kill the child once it has work and has said nothing for ``hang_seconds``."""
        while not (self.gate.closing or self.died.is_set()):
            time.sleep(min(1.0, self.hang_seconds / 4))
            if self.busy and time.monotonic() - self._heard > self.hang_seconds:
                self._hung = True
                self._process.kill()  # the reader then sees the pipe close: died
                return

    tokenizer = property(lambda self: self.pair.tokenizer, doc="The pair's tokenizer.")
    pid = property(lambda self: self._process.pid, doc="The engine process's id.")
    chat = property(lambda self: self.pair.chat, doc="Whether text prompts get the chat template.")
    names = property(lambda self: self.pair.names, doc="The models' names and the backend.")

    def submit(self, request: ServeRequest) -> Ticket:
        """Queue a request; its ticket at once (``QueueFull``, ``EngineClosed``, ``ValueError``)."""
        check_served(self.pair, request)  # here: a refusal comes before anything is sent
        config = request.settings
        rid = new_id()
        ticket = Ticket(rid, len(request.prompt_ids), request.stop, self.abort, decode=self.pair.decode_bytes)
        if not self.busy:  # an idle child says nothing; the wait starts now
            self._heard = time.monotonic()
        self.gate.enter(rid, ticket, config.n_particles)
        self._send(("add", rid, request))
        return ticket

    def abort(self, work_id: str) -> None:
        """Cancel a request: it leaves at the next boundary."""
        with contextlib.suppress(OSError, EOFError):
            self._send(("abort", work_id))

    def stats(self) -> EngineStats:
        """What the engine holds and has done (as of its latest step)."""
        s = self._stats
        with self.gate.lock:
            live = len(self.gate.live)
        return self.gate.stats(s, max(0, live - s.running), self.pair.facts)

    def close(self, cancel: bool = False) -> None:
        """Take no more requests; finish (or cancel) those queued and running; stop the child."""
        if self.gate.closing:
            return
        self.gate.close()
        with contextlib.suppress(OSError, EOFError):
            self._send(("close", cancel))
        self._process.join()
        self._reader.join(timeout=10)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(cancel=exc[0] is not None)

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        """The child's outputs to their tickets, until it exits (then whatever is left fails).

        If this thread itself fails, no output can reach a ticket any more: the engine is as
        good as dead, and says so (the child is stopped, ``alive`` turns False).
        """
        try:
            while True:
                outputs, self._stats = self._conn.recv()
                self._heard = time.monotonic()
                for out in outputs:
                    ticket = self.gate.handle(out.id, out.finished)
                    if ticket is not None:
                        ticket.apply(out)
        except (EOFError, OSError):
            pass
        except BaseException as err:  # noqa: BLE001 - a reader that dies must not leave requests hanging
            self.reader_failure = f"{type(err).__name__}: {err}"
            self._process.kill()
        if not self.gate.closing:  # nobody asked it to end
            self._process.join(timeout=5)
            self.died.set()
        for work_id, ticket in self.gate.close():
            self.gate.handle(work_id, done=True)
            ticket.fail(RequestCancelled(f"the engine process ended before request {work_id} finished"))


def _engine_main(conn, spec, base: SMCConfig, max_rows: int) -> None:
    """The child: load the pair, then serve messages and step until told to close."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops us (a terminal's Ctrl-C reaches both)
    torch_thread().adopt()  # this thread runs every torch operation of the process
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the parent shows its own status line
        with warnings.catch_warnings(record=True) as caught:  # the parent says them, not our stderr
            warnings.simplefilter("always")
            pair = spec.load()
        pair.core.build_forwards(background=True)  # answers at once; compiled parts as they come
        core = EngineCore(pair.core, base, max_rows=max_rows, keep_draft=True)  # requests come one by one
    except BaseException as err:  # noqa: BLE001 - the parent raises it
        conn.send(("error", err))
        return
    facts = dict(tokenizer=pair.tokenizer, chat=pair.chat, names=pair.core.names, facts=pair.core.facts)
    conn.send(("ready", facts | {"notes": [(w.category, str(w.message)) for w in caught]}))
    closing, told = False, time.monotonic()
    while not (closing and not core.has_work):
        wait = 0 if core.has_work or closing else None
        refused = []
        while conn.poll(wait):  # every message that has arrived, then a step
            done, failed = _take(conn.recv(), core, pair.core)
            closing, refused, wait = closing or done, refused + failed, 0
        busy = core.has_work
        outputs = refused + (core.step() if busy else [])
        if busy and not core.has_work:  # idle now: the rows are freed (``EngineCore``), and so is the heap
            _trim_heap()
        if outputs or time.monotonic() - told > HEARTBEAT_SECONDS:  # a cycle with nothing to tell says so
            conn.send(([replace(o, population=None) for o in outputs], core.stats))
            told = time.monotonic()
    conn.send(([], core.stats))
    conn.close()
    # Everything is said: end now. Finalizing an interpreter that holds torch and the models
    # takes about a second, which a server's drain would wait out (its --grace-seconds).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _trim_heap() -> None:
    """Hand the C allocator's free pages back to the system (glibc), so an idle engine's RSS is what it holds.

    A cycle's activations are freed into the allocator's arenas, which keep them: after a burst
    the process would stay as large as its largest cycle, and vary with whichever that was.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _take(message: tuple, core: EngineCore, pair) -> tuple[bool, list[Output]]:
    """Apply one message to the core: whether it says to close, and the requests it refused."""
    kind, *rest = message
    if kind == "add":
        rid, request = rest
        try:  # checked by the parent already; a failure here still answers
            program = program_of(pair, request)
        except ValueError as err:
            return False, [Output(rid, error=err, finished=True)]
        config = request.settings
        seed = request_seed(config.seed, 0)
        arrival = time.perf_counter()
        scores = dict(logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs)
        core.add(Request(program, config, seed, request.stop, arrival=arrival, id=rid, **scores))
    elif kind == "abort":
        core.abort(rest[0])
    elif kind == "close":
        if rest[0]:  # cancelling what waits and runs
            for work in (*core.waiting, *core.running):
                core.abort(work.id)
        return True, []
    return False, []

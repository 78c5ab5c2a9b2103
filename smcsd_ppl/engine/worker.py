"""The process's one torch thread: the library's model work runs here, never on its callers' threads.

Every thread that runs torch operations gets an OpenMP thread team of its own, and two teams
busy on the same cores slow every operation down (DESIGN.md, decision 17). So loading a pair,
every method's call and every engine's cycles run on this one thread, in turn: a job, then a
cycle of each engine with work, and so on. Callers block (or await) on the result. Idle, the
thread waits on a condition and uses no CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Protocol

import torch


class Turns(Protocol):
    """What the thread runs in turn: an engine with work takes one turn (one cycle or one call)."""

    threads: int  # torch's thread count for its turns (0: leave as is)

    @property
    def ready(self) -> bool:
        """It has something to do."""

    def turn(self) -> None:
        """Do one unit of it."""

    def crashed(self, err: BaseException) -> None:
        """A turn raised ``err``: fail what it holds."""


class TorchThread:
    """One thread for the process's torch work: jobs (``run``) and engines' turns, interleaved."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Callable[[], object], Future, int]] = deque()
        self._engines: weakref.WeakSet = weakref.WeakSet()
        self._thread: threading.Thread | None = None
        self._threads = 0  # torch's thread count on this thread, as last set
        self._closing = False

    @property
    def here(self) -> bool:
        """Whether the caller runs on this thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def adopt(self) -> None:
        """Make the calling thread the process's torch thread (an engine process's main thread)."""
        with self._cond:
            if self._thread is not None and self._thread is not threading.current_thread():
                raise RuntimeError("this process's torch thread is already another thread")
            self._thread = threading.current_thread()

    def run(self, fn: Callable[[], object]) -> object:
        """``fn()`` on this thread, with the caller's torch thread count; its result (or its error)."""
        if self.here:
            return fn()
        return self.submit(fn).result()

    def submit(self, fn: Callable[[], object]) -> Future:
        """Queue ``fn()``; a future of its result."""
        future: Future = Future()
        with self._cond:
            self._jobs.append((fn, future, torch.get_num_threads()))
            self._start()
            self._cond.notify()
        return future

    def attach(self, engine: Turns) -> None:
        """Give ``engine`` turns while it is ``ready`` (held weakly: a dropped engine leaves)."""
        with self._cond:
            self._engines.add(engine)
            self._start()

    def wake(self) -> None:
        """An attached engine may have become ready (the thread starts again if it was stopped)."""
        with self._cond:
            self._start()
            self._cond.notify()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, daemon=True, name="smcsd-torch")
            self._thread.start()

    def stop(self, grace: float = 2.0) -> bool:
        """End the thread after its current job or turn; whether it ended.

        For a process about to exit: an interpreter that finalizes while this daemon thread is
        inside a torch kernel aborts the process ("terminate called without an active
        exception"). A job still running after ``grace`` seconds gets a ``KeyboardInterrupt``,
        raised at its next Python line (between two torch operations). Queued jobs fail with it.
        """
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        with self._cond:
            self._closing = True
            self._cond.notify()
        thread.join(grace)
        if thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt)
            )
            thread.join(grace)
        with self._cond:
            while self._jobs:
                self._jobs.popleft()[1].set_exception(KeyboardInterrupt())
            if not thread.is_alive():
                self._thread, self._closing = None, False
        return not thread.is_alive()

    def _main(self) -> None:
        while self._serve_once():
            pass

    def _serve_once(self) -> bool:
        """Wait for work; run one job, then one turn of each ready engine. False: the thread ends.

        A function of its own so that what it held (a job's closure and result, an engine) is
        let go when it returns: a pair or engine its caller dropped is not kept alive by an idle
        thread until the next job comes.
        """
        with self._cond:
            ready = [e for e in self._engines if e.ready]
            while not self._jobs and not ready and not self._closing:
                self._cond.wait()
                ready = [e for e in self._engines if e.ready]
            if self._closing:
                return False
            job = self._jobs.popleft() if self._jobs else None
        if job is not None:
            self._job(*job)
        for engine in ready:  # one turn each, then the next job
            self.use_threads(engine.threads)
            try:
                engine.turn()
            except BaseException as err:  # noqa: BLE001 - a bug in a turn fails its engine's work only
                engine.crashed(err)
        return True

    def _job(self, fn: Callable[[], object], future: Future, threads: int) -> None:
        if not future.set_running_or_notify_cancel():
            return
        self.use_threads(threads)
        try:
            future.set_result(fn())
        except BaseException as err:  # noqa: BLE001 - the caller gets it
            future.set_exception(err)

    def use_threads(self, threads: int) -> None:
        """Run torch with ``threads`` threads here (OpenMP's count is per thread; 0 keeps it)."""
        if threads and threads != self._threads:
            # through torch._C: vLLM's CPU worker makes torch.set_num_threads a no-op
            torch._C.set_num_threads(threads)
            self._threads = threads


_THREAD = TorchThread()


def torch_thread() -> TorchThread:
    """The process's torch thread."""
    return _THREAD


@contextlib.contextmanager
def entered_on_torch_thread(manager: contextlib.AbstractContextManager) -> Iterator[object]:
    """``with manager`` entered and left on the torch thread.

    Torch modes (a dispatch mode that counts host reads, say) hold only on the thread that
    enters them, and the models run on the torch thread.
    """
    value = _THREAD.run(manager.__enter__)
    try:
        yield value
    finally:
        _THREAD.run(lambda: manager.__exit__(None, None, None))

"""Who may come into an engine, and what it reports: the gate that holds every request in, its stats.

A request is refused (``QueueFull``) only when the rows cannot take it and ``max_queue``
requests already wait beyond them; none comes in once the engine closes (``EngineClosed``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .core import CoreStats
from .pair import PairFacts
from .scheduling import waiting_beyond


class QueueFull(RuntimeError):
    """The rows are taken and the queue is full: try again later."""


class EngineClosed(RuntimeError):
    """The engine is closed (or closing) and takes no more requests."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine: its queue, its rows, what it has done."""

    queued: int
    running: int
    rows_in_use: int
    max_rows: int
    max_queue: int
    requests_total: dict[str, int]
    tokens_total: int
    cycles_total: int
    cycle_seconds_total: float
    last_cycle_seconds: float
    last_mean_ess: float
    kv_cache_bytes: int = 0
    kv_budget_bytes: int = 0
    kv_bytes_per_row_position: int = 0


class Gate:
    """Who may come in: all while the rows can take them, then ``max_queue`` more; none once closed.

    It holds every request in (by id, in arrival order, with its rows) until it is done.
    """

    def __init__(self, max_queue: int, max_rows: int) -> None:
        if max_queue < 1 or max_rows < 1:
            raise ValueError("max_queue and max_rows must be at least 1")
        self.max_queue, self.max_rows = max_queue, max_rows
        self.lock = threading.Lock()
        self.live: dict[str, tuple[object, int]] = {}  # id -> (handle, rows)
        self.rejected, self.closing = 0, False

    def enter(self, work_id: str, handle: object, rows: int, bounded: bool = True) -> None:
        """Let a request in with its caller's handle (``QueueFull``, ``EngineClosed``, ``ValueError``)."""
        if rows > self.max_rows:
            raise ValueError(f"the request needs {rows} rows (particles x contexts); at most {self.max_rows}")
        with self.lock:
            if self.closing:
                raise EngineClosed("the engine is closed")
            held = [n for _, n in self.live.values()]
            if bounded and waiting_beyond(held, rows, self.max_rows) > self.max_queue:
                self.rejected += 1
                raise QueueFull(
                    f"the rows are taken and {self.max_queue} requests wait for them; try again later"
                )
            self.live[work_id] = (handle, rows)

    def handle(self, work_id: str, done: bool) -> object:
        """A request's handle (None if gone); forgotten once ``done``."""
        with self.lock:
            handle, _ = self.live.get(work_id, (None, 0))
            if done:
                self.live.pop(work_id, None)
        return handle

    def stats(self, s: CoreStats, queued: int, facts: PairFacts) -> EngineStats:
        """An engine's snapshot: the core's counters ``s``, ``queued`` waiting, the gate's, the KV figures."""
        return EngineStats(
            queued,
            s.running,
            s.rows_in_use,
            self.max_rows,
            self.max_queue,
            dict(s.counts) | {"rejected": self.rejected},
            s.tokens,
            s.cycles,
            s.cycle_seconds,
            s.last_seconds,
            s.last_ess,
            s.kv_bytes,
            facts.kv_budget_bytes,
            facts.kv_bytes_per_position,
        )

    def close(self) -> list[tuple[str, object]]:
        """Let nothing more in; the requests still in, with their handles."""
        with self.lock:
            self.closing = True
            return [(work_id, handle) for work_id, (handle, _) in self.live.items()]

"""What runs next, as a value: ``schedule(waiting, running, capacity) -> Plan``; and who may queue.

The engine applies the plan at a cycle boundary and nothing else decides. Requests are taken
in arrival order (one that does not fit holds those behind it back, so none starves); a
request joins the running batch only if it shares the batch's settings (``SHARED_SETTINGS``)
and its rows fit. A request of other settings waits for the batch to drain and then starts
its own; meanwhile those behind it that share the batch's settings still join, until it has
been passed ``MAX_PASSED`` times (then the batch drains for it). A call waits for the batch to
drain and runs alone; nothing passes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .request import Call, Request, Work

MAX_PASSED = 16  # admissions behind a request of other settings before the batch drains for it


@dataclass(frozen=True)
class Capacity:
    """What the rows can take now.

    Attributes:
        max_rows: rows the running requests may hold in all.
        draft_ready: the row store holds the draft's rows too; when it does not (a batch
            that decodes with the target alone), a request that drafts from its first cycle
            waits for that batch to drain.
    """

    max_rows: int
    draft_ready: bool = True


@dataclass(frozen=True)
class Plan:
    """One boundary's decision.

    Attributes:
        drop: running requests that leave now (cancelled).
        cancel: waiting requests or calls that end without running (cancelled).
        admit: waiting requests that join the batch now, in order.
        call: a call to run now (the batch is empty and stays so while it runs).
        passed: waiting requests of other settings that requests behind them passed now.
    """

    drop: tuple[Request, ...] = ()
    cancel: tuple[Work, ...] = ()
    admit: tuple[Request, ...] = ()
    call: Call | None = None
    passed: tuple[Request, ...] = ()


def schedule(waiting: Sequence[Work], running: Sequence[Request], capacity: Capacity) -> Plan:
    """The plan for the next cycle: who leaves, who joins, or which call runs.

    ``waiting`` in arrival order; ``running`` in batch order. A request's ``drafts`` says
    whether it drafts from its first cycle (read with ``capacity.draft_ready``).
    """
    drop = tuple(r for r in running if r.cancelled)
    staying = [r for r in running if not r.cancelled]
    rows = sum(r.rows for r in staying)
    group = staying[0].group if staying else None
    cancel, admit, call, passed = [], [], None, []
    for work in waiting:
        if work.cancelled:
            cancel.append(work)
            continue
        if isinstance(work, Call):
            if not staying and not admit:
                call = work
            break
        if group is not None and work.group != group:
            if work.passed >= MAX_PASSED:  # its turn: nothing more joins, the batch drains for it
                break
            passed.append(work)  # its batch starts once this one drains; those behind still join
            continue
        if rows + work.rows > capacity.max_rows or _drafts_too_late(work, staying, capacity):
            break
        admit.append(work)
        rows += work.rows
        group = work.group
    return Plan(drop, tuple(cancel), tuple(admit), call, tuple(passed) if admit else ())


def _drafts_too_late(request: Request, staying: list[Request], capacity: Capacity) -> bool:
    """A drafting request waits while rows the draft does not hold are in use."""
    return bool(staying) and not capacity.draft_ready and request.drafts


def waiting_beyond(held: Sequence[int], rows: int, max_rows: int) -> int:
    """How many requests would wait for rows, were one of ``rows`` rows to join those holding ``held``.

    ``held``: the rows of the requests already in (running or waiting), in arrival order.
    Requests are admitted in that order, so those past ``max_rows`` in all wait.
    """
    total, beyond = 0, 0
    for n in [*held, rows]:
        total += n
        beyond += total > max_rows
    return beyond

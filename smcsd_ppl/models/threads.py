"""torch's CPU threads on a shared machine.

torch starts one thread per core and its threads wait for each other at every operation, so
when other processes hold some of the cores a forward slows by far more than the share of CPU
lost (about 20x for the 135M model on a busy 2-core machine). On such a machine fewer
threads, as many as the load leaves free, are faster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import available_cores, check_threads

# Any of these set means someone chose the thread count: it is left alone.
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class ThreadChoice:
    """Threads chosen for a busy machine, and why: its 1-minute load average over its cores."""

    threads: int
    load: float
    cores: int

    def describe(self) -> str:
        """One line for users."""
        return (
            f"the CPU is busy (load average {self.load:.1f} on {self.cores} cores): "
            f"torch runs {self.threads} thread(s)"
        )


def free_cores(load: float, cores: int) -> int:
    """The cores a load average leaves free, at least 1."""
    return max(1, cores - round(load))


def choose_threads(threads: int | None = None) -> ThreadChoice | None:
    """Set torch's CPU threads: ``threads`` if given, else fewer on a busy machine.

    With ``threads=None`` the count is lowered only where nobody chose one (no
    ``OMP_NUM_THREADS``, torch still at one thread per core) and the load average leaves
    fewer cores free than torch runs threads.

    Returns:
        The choice made for a busy machine; None when ``threads`` was given or nothing changed.
    """
    import torch

    check_threads(threads)
    if threads is not None:
        torch.set_num_threads(threads)
        return None
    cores, current = available_cores(), torch.get_num_threads()
    if any(os.environ.get(v) for v in _THREAD_VARIABLES) or current < cores or not hasattr(os, "getloadavg"):
        return None
    load = os.getloadavg()[0]
    free = free_cores(load, cores)
    if free >= current:
        return None
    torch.set_num_threads(free)
    return ThreadChoice(free, load, cores)

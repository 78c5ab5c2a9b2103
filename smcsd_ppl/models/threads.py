"""torch's CPU threads on a shared machine: the user's choice, else torch's own; a warning when busy.

torch runs one thread per core, and its threads wait for each other at every operation, so
when other processes hold some of the cores a forward slows by far more than the share of
CPU lost. Fewer threads would then be faster, but a choice made from one moment's load
outlives it (the process that just finished leaves a load average behind for a minute).
So the count is never lowered behind the user's back: ``threads=``, ``--threads`` or
``OMP_NUM_THREADS`` choose it, and a load that other processes put on the CPU *while a pair
loads* (measured from ``/proc``, the process's own work excluded) only earns a warning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import available_cores, check_threads

BUSY_CORES = 0.5  # other processes using more than this many cores during a load earn a warning


class BusyCPUWarning(UserWarning):
    """Other processes kept the CPU busy while a pair loaded: torch's threads will contend with them."""


def set_threads(threads: int | None) -> None:
    """Set torch's CPU threads to ``threads`` (checked); None leaves torch's own count."""
    import torch

    check_threads(threads)
    if threads is not None:
        torch.set_num_threads(threads)


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy ticks of the whole machine, ticks of this process) from ``/proc``; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, int(own[11]) + int(own[12])  # utime + stime of every thread


@dataclass(frozen=True)
class OtherLoad:
    """Cores other processes kept busy over an interval, on a machine of ``cores`` cores."""

    cores_used: float
    cores: int

    @property
    def busy(self) -> bool:
        """Enough to slow torch's threads down."""
        return self.cores_used > BUSY_CORES

    def describe(self) -> str:
        """One line for users."""
        import torch

        return (
            f"other processes kept {self.cores_used:.1f} of {self.cores} CPU cores busy while the models "
            f"loaded; torch runs {torch.get_num_threads()} thread(s) and will be slower while that lasts"
        )


class LoadWatch:
    """Measures the CPU other processes use between its start and ``stop`` (this one's own work excluded)."""

    def __init__(self) -> None:
        self.start = _cpu_ticks(), os.times().elapsed

    def stop(self) -> OtherLoad | None:
        """The other processes' load since the start; None where ``/proc`` cannot tell."""
        (before, then), now = self.start, _cpu_ticks()
        elapsed = os.times().elapsed - then
        if before is None or now is None or elapsed <= 0:
            return None
        ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        others = (now[0] - before[0]) - (now[1] - before[1])
        return OtherLoad(max(0.0, others / ticks / elapsed), available_cores())


def chosen_by_user(threads: int | None) -> bool:
    """Whether someone chose the thread count (``threads``, or an OpenMP/MKL variable)."""
    return threads is not None or any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))

"""Counting host reads of model-derived values: the syncs an accelerator would pay.

On a GPU, reading a value the device computed (``.item()``, ``.tolist()``, ``bool()``,
``.cpu()``, an op whose output shape depends on data) makes the host wait for every
queued kernel. ``HostReads`` is a ``TorchFunctionMode`` that follows provenance from
the models' weights through every torch op and counts such reads, so the count is the
same on a CPU (where these reads are free) as on an accelerator, and a test can hold
an engine to a budget without a GPU. Reads of tensors built from host data (token
lists, masks) are not counted: they never need to come back from the device. A copy
to the host is counted when written ``.cpu()`` (on a CPU, ``.to(device)`` cannot be
told apart from a dtype cast or a no-op move, so this code base writes D2H as ``cpu()``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

READS = {"tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__"}
DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal"}


class HostReads(TorchFunctionMode):
    """Counts host reads of values derived from ``modules``' weights while active.

    Attributes:
        count: reads so far.
        names: the reading function of each read, in order (for error messages).
    """

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        super().__init__()
        self.count, self.names = 0, []
        self.derived: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        for m in modules:
            for t in [*m.parameters(), *m.buffers()]:
                self.derived[id(t)] = t

    def is_derived(self, x: object) -> bool:
        """Whether ``x`` (or a tensor inside a list or tuple) came from the weights."""
        if isinstance(x, torch.Tensor):
            return self.derived.get(id(x)) is x
        if isinstance(x, (list, tuple)):
            return any(self.is_derived(v) for v in x)
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        """Run ``func``; count it if it reads a derived value; mark its outputs."""
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tainted = self.is_derived(args) or self.is_derived(list(kwargs.values()))
        out = func(*args, **kwargs)
        if not tainted:
            return out
        if name in READS or name in DATA_DEPENDENT or name == "cpu":
            self.count += 1
            self.names.append(name)
            if name == "cpu":  # a host copy: reading it is free (on a CPU, cpu() returns self)
                return out.clone() if out is args[0] else out
        if (
            name == "__setitem__"
            or (name.endswith("_") and not name.endswith("__"))
            or name.startswith("__i")
        ):
            self._mark(args[0])  # in place: the target now holds derived values
        self._mark(out)
        return out

    def _mark(self, out: object) -> None:
        if isinstance(out, torch.Tensor):
            self.derived[id(out)] = out
        elif isinstance(out, (list, tuple)):
            for v in out:
                self._mark(v)


@contextmanager
def reads_per_cycle(target, modules: Iterable[torch.nn.Module]) -> Iterator[list[int]]:
    """Count host reads between successive ``target`` forwards (one cycle each).

    Yields a list that fills with one count per cycle: reads from the start of a target
    forward to the start of the next. The reads before the first forward are not a cycle.
    """
    counts: list[int] = []
    mode = HostReads(modules)
    seen = [0, False]

    def wrap(fn):
        def run(*args, **kwargs):
            if seen[1]:
                counts.append(mode.count - seen[0])
            seen[0], seen[1] = mode.count, True
            return fn(*args, **kwargs)

        return run

    patched = {n: getattr(target, n) for n in ("extend", "prefill") if hasattr(target, n)}
    for n, fn in patched.items():
        setattr(target, n, wrap(fn))
    try:
        with mode:
            yield counts
    finally:
        for n in patched:
            delattr(target, n)  # back to the class's method

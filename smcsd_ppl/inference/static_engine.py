"""The static path's state: both models' static forwards, their arenas and graphs, kept across calls.

Arenas are allocated once per (model, row bucket, capacity bucket) and reused, so a captured
CUDA graph always finds its buffers where it wrote them; graphs are built once per step
kind and shape. ``mode``: ``"eager"`` (the same code uncompiled, the reference),
``"compile"`` or ``"cuda-graph"`` (``backends.graphs``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..backends.base import ForwardStats
from ..backends.graphs import Graphed
from ..backends.static import Arena, StaticLlama, capacity_bucket
from ..config import EXECUTION_ENGINES

DETERMINISTIC_ROWS = 64  # the row bucket of --deterministic: 8 requests of 8 particles per batch


def graph_mode(engine: str, device: torch.device) -> str:
    """The graph mode of an ``--engine`` choice on ``device``.

    ``compiled`` is CUDA graphs on CUDA and ``torch.compile`` elsewhere. ``auto`` is compiled
    on CUDA only: on a CPU compiling costs a minute or more per shape and pays little
    (docs/benchmarks.md, "The static path"), so it stays an explicit choice there.
    """
    if engine not in EXECUTION_ENGINES:
        raise ValueError(f"engine must be one of {EXECUTION_ENGINES}, got {engine!r}")
    if engine == "eager" or (engine == "auto" and device.type != "cuda"):
        return "eager"
    return "cuda-graph" if device.type == "cuda" else "compile"


class StaticEngine:
    """Static forwards of a target (and a draft), with their arenas and graphs.

    Args:
        target: the target's HF model (a Llama).
        draft: the draft's HF model (a Llama), or None for runs without one.
        mode: ``"eager"``, ``"compile"`` or ``"cuda-graph"``.
        stats: the forward counters to add to (the eager backends', so call stats read alike).
        row_bucket: run SMC-SD requests in batches of exactly this many rows, each prompt
            prefilled alone (``--deterministic``); None: a batch's own rows.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module | None,
        mode: str,
        stats: tuple[ForwardStats, ForwardStats] | None = None,
        row_bucket: int | None = None,
    ) -> None:
        self.target = StaticLlama(target)
        self.draft = StaticLlama(draft) if draft is not None else None
        self.mode = mode
        self.row_bucket = row_bucket
        # The forwards are counted where the eager backends count theirs, so a call's stats read the same.
        self.target_stats, self.draft_stats = stats or (ForwardStats(), ForwardStats())
        self.arenas: dict[tuple, Arena] = {}
        self.kept: dict[tuple, object] = {}
        self.graphs: dict[tuple, Graphed] = {}
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.target.device)

    @property
    def compile_seconds(self) -> float:
        """Time spent compiling or capturing graphs so far."""
        return sum(g.seconds for g in self.graphs.values())

    def arena(self, which: str, rows: int, columns: int) -> Arena:
        """``which`` model's arena of ``rows`` rows holding ``columns`` positions, emptied."""
        model = self.target if which == "target" else self.draft
        capacity = capacity_bucket(columns, model.max_length)
        key = (which, rows, capacity)
        if key not in self.arenas:
            self.arenas[key] = model.arena(rows, capacity)
        arena = self.arenas[key]
        arena.lengths.zero_()  # old keys and values stay: masked until overwritten
        return arena

    def buffers(self, key: tuple, make: Callable[[], object]) -> object:
        """Buffers kept across calls under ``key`` (made by ``make()`` once): a graph's inputs stay put."""
        if key not in self.kept:
            self.kept[key] = make()
        return self.kept[key]

    def graph(self, key: tuple, build: Callable[[], Callable]) -> Graphed:
        """The graph of step ``key`` (built by ``build()`` on first use)."""
        if key not in self.graphs:
            self.graphs[key] = Graphed(build(), self.mode)
        return self.graphs[key]

    def flag_nan(self, seen: torch.Tensor) -> None:
        """Remember that a step saw NaN logits (read by ``check_finite``, not now)."""
        self.nonfinite |= seen

    def check_finite(self) -> None:
        """Raise if any step since the last check produced NaN logits (one host read)."""
        bad = bool(self.nonfinite)
        self.nonfinite.zero_()
        if bad:
            raise ValueError("the model produced NaN logits (try dtype=float32, or check the weights)")

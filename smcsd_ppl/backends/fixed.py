"""A backend whose forwards run at set shapes: fixed ones for batch invariance, buckets for graphs.

The bits of a product depend on its shape: how many rows, how many positions per row, how
many columns attention reads. ``ShapedLM`` runs every forward at shapes its policy sets, the
rows it holds padded with hole rows, the cache allocated to match:

- ``FixedShape`` (``--deterministic``): always the same rows and columns, each prompt prefilled
  alone at its own length, and a forward's rows grouped by their own count of fed tokens, each
  group at the next power of two (``bucket``), the other rows holes. What a row computes then
  depends on itself alone, not on where its batch-mates put their tokens. It costs the rows
  (a CPU computes every hole) and a forward per group.
- ``Buckets`` (an accelerator's): rows and columns by powers of two and steps of 256, so that
  forwards fall on few shapes and each shape's CUDA graph (``graphs.CudaGraphs``) is replayed.

The CPU tricks, which shape forwards by what the rows hold, are off; token trees, whose columns
two groups would share before they are kept, are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import cpu
from .base import to_device
from .graphs import CudaGraphs
from .hf import HFBatchedLM
from .kv import Feed


def bucket(count: int) -> int:
    """The positions a row fed ``count`` tokens runs at: the next power of two."""
    return 1 << max(0, count - 1).bit_length()


@dataclass(frozen=True)
class FixedShape:
    """The rows and attention columns of every forward (``--deterministic``).

    Attributes:
        rows: rows every forward runs (a batch holds at most these).
        width: columns attention reads: the context of every row.
    """

    rows: int = 64
    width: int = 1024
    alone = True  # each prompt is prefilled by itself

    def __post_init__(self) -> None:
        if self.rows < 1 or self.width < 2:
            raise ValueError(f"a fixed shape needs rows >= 1 and width >= 2, got {self.rows} x {self.width}")

    def rows_for(self, n: int) -> int:
        """The rows a forward over ``n`` held rows runs."""
        if n > self.rows:
            raise ValueError(f"{n} rows pass the fixed {self.rows} (--deterministic)")
        return self.rows

    def width_for(self, needed: int) -> int:
        """The columns attention reads where ``needed`` are needed."""
        if needed > self.width:
            raise ValueError(f"{needed} positions pass the fixed width of {self.width} (--deterministic)")
        return self.width


@dataclass(frozen=True)
class Buckets:
    """Rows by powers of two, columns by steps of ``step``: few shapes, each one graph."""

    step: int = 256
    alone = False  # prompts are prefilled together (their shapes are not replayed)

    def rows_for(self, n: int) -> int:
        """The rows a forward over ``n`` held rows runs: the next power of two."""
        return bucket(n)

    def width_for(self, needed: int) -> int:
        """The columns attention reads: the next multiple of ``step``."""
        return -(-needed // self.step) * self.step


class ShapedLM(HFBatchedLM):
    """``HFBatchedLM`` whose forwards run at the shapes of ``shape`` (see the module).

    Args:
        model: as ``HFBatchedLM``'s.
        shape: a ``FixedShape`` or ``Buckets``.
        graphs: replay each forward shape as a CUDA graph (on CUDA; None: launch as usual).
        **kwargs: ``HFBatchedLM``'s other arguments (its CPU tricks are off here).
    """

    def __init__(self, model: torch.nn.Module, shape, *, graphs: CudaGraphs | None = None, **kwargs) -> None:
        kwargs["tricks"] = cpu.NO_TRICKS
        super().__init__(model, **kwargs)
        if self.reads_hidden:
            raise ValueError("shaped forwards cannot run a feature draft: its states are read in one block")
        self.shape, self.graphs = shape, graphs
        self.rows_held = 0  # the cache's rows, the held ones and holes after them
        self.generation = 0  # moves whenever the cache's buffers do (a graph reads them in place)
        if isinstance(shape, FixedShape):
            self.max_length = min(self.max_length, shape.width)  # the fixed width is the context now

    # Prompts, into rows of the one cache.
    def _prefill(self, prompts: Sequence[Sequence[int]], hidden) -> torch.Tensor:
        self.shape.rows_for(len(prompts))
        if not self.shape.alone:
            return super()._prefill(prompts, hidden)
        logits = [self._prefill_padded([prompts[0]], hidden)]
        return torch.cat(logits + [self._append([p]) for p in prompts[1:]])

    def _prefill_padded(self, prompts: Sequence[Sequence[int]], hidden) -> torch.Tensor:
        self.rows_held = 0
        logits = super()._prefill_padded(prompts, hidden)
        self._fit(len(prompts))
        return logits

    @torch.inference_mode()
    def _append(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The prompts prefilled as ``_prefill`` does, their cache rows copied into the next free rows."""
        held = self.cache, self.lengths, self.bound, self.nonfinite, self.contents, self.rows_held
        n = len(held[2])
        self.shape.rows_for(n + len(prompts))
        logits = self._prefill(prompts, None)
        fresh, self.cache, self.rows_held = self.cache, held[0], held[5]
        self._fit(n + len(prompts), fresh.capacity)
        for mine, theirs in zip(self.cache.layers, fresh.layers):
            m = len(prompts)
            mine.keys[n : n + m, :, : fresh.capacity] = theirs.keys[:m]
            mine.values[n : n + m, :, : fresh.capacity] = theirs.values[:m]
        self.contents.held = held[4].held + self.contents.held
        self.lengths = torch.cat([held[1], self.lengths])
        self.bound = held[2] + self.bound
        self.nonfinite = self.nonfinite | held[3]
        return logits

    def _fit(self, n: int, width: int = 0) -> None:
        """Give the cache the rows ``n`` held rows run at, and ``width`` columns at least.

        Rows and columns only grow (a graph's shape, once met, stays); each growth moves the buffers.
        """
        rows = max(self.rows_held, self.shape.rows_for(n))
        capacity = max(self.cache.capacity, self.shape.width_for(max(width, 1)))
        layer = self.cache.layers[0] if self.cache.layers else None
        if layer is not None and layer.keys.shape[0] == rows and layer.keys.shape[2] == capacity:
            self.rows_held = rows
            return

        def fitted(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(rows, t.shape[1], capacity, t.shape[3])
            out[: t.shape[0], :, : t.shape[2]] = t
            return out

        self._check_budget(rows, capacity)
        self.cache.map(fitted)
        self.cache.capacity, self.rows_held = capacity, rows
        self.generation += 1

    @torch.inference_mode()
    def fork(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows`` in order; the cache keeps its rows (those past them stay as they are)."""
        if rows.numel() == 0:
            raise ValueError(f"{self.name}: fork() needs at least one row")
        host = rows.tolist()
        self._fit(len(host))
        physical = host + list(range(len(host), self.rows_held))  # the rows past them: themselves
        used = max(self.bound, default=0)
        self.cache.fork(to_device(torch.tensor(physical), self.device), physical, used, self.cache.capacity)
        self.contents.fork(host, len(host))
        self.lengths = self.lengths.index_select(0, to_device(rows, self.device))
        self.bound = [self.bound[i] for i in host]
        self.tree_width = 0

    def reserve(self, rows: int, width: int) -> None:
        """Columns for ``width`` positions, by the shape's rule (a fresh cache's layers come at it)."""
        width = self.shape.width_for(width)
        if not self.cache.layers:
            self._check_budget(self.shape.rows_for(rows), width)
            self.cache.capacity = max(self.cache.capacity, width)
        elif width > self.cache.capacity:
            self._fit(rows, width)

    # Forwards: the set rows and columns, each row's positions by its own count.
    def _width(self, needed: int) -> int:
        return max(self.shape.width_for(needed), self.cache.capacity if self.cache else 0)

    def _shaped(self, lengths: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        extra = max(self.rows_held, self.shape.rows_for(len(lengths))) - len(lengths)
        return (
            torch.cat([lengths, lengths.new_zeros(extra)]),
            torch.cat([valid, valid.new_zeros(extra, valid.shape[1])]),
        )

    def _shaped_ids(self, ids: torch.Tensor) -> torch.Tensor:
        extra = max(self.rows_held, self.shape.rows_for(len(ids))) - len(ids)
        return torch.cat([ids, ids.new_zeros(extra, ids.shape[1])])

    def _extend(self, tokens: torch.Tensor, valid, hidden, vocab) -> torch.Tensor:
        """A forward per group of rows fed like counts (by ``bucket``), each at its bucket's width.

        A row's real tokens run packed to the right of its group's positions, in order; holes
        between them are left out (a hole is seen by nothing), and their logits come back 0.
        """
        r, t = tokens.shape
        valid = torch.ones(tokens.shape, dtype=torch.bool) if valid is None else valid.cpu()
        counts = valid.sum(1).tolist()
        out = None
        for width in sorted({bucket(c) for c in counts if c}):
            rows = [i for i, c in enumerate(counts) if c and bucket(c) == width]
            src_r = [i for i in rows for _ in range(counts[i])]
            src_c = [int(j) for i in rows for j in valid[i].nonzero()[:, 0]]
            dst_c = [width - counts[i] + n for i in rows for n in range(counts[i])]
            fed = torch.zeros(r, width, dtype=torch.bool)
            fed[src_r, dst_c] = True
            at = [to_device(torch.tensor(x), tokens.device) for x in (src_r, src_c, dst_c)]
            ids = torch.zeros(r, width, dtype=tokens.dtype, device=tokens.device)
            ids[at[0], at[2]] = tokens[at[0], at[1]]
            vocab_on = None if vocab is None else to_device(vocab, self.device)
            logits = self._forward(ids, fed, last_only=False, vocab=vocab_on)  # [r, width, V]
            out = logits.new_zeros(r, t, logits.shape[-1]) if out is None else out
            at = [a.to(out.device) for a in at]
            out[at[0], at[1]] = logits[at[0], at[2]]
        if out is None:  # no row fed: nothing runs
            return torch.zeros(r, t, self.vocab_size if vocab is None else len(vocab), device=self.device)
        return out

    def _run(self, ids: torch.Tensor, feed: Feed, options: dict):
        """The model's forward, replayed from its shape's CUDA graph where there are graphs."""
        if self.graphs is None or self.device.type != "cuda" or options.get("read") is not None:
            return super()._run(ids, feed, options)
        cache = feed.cache
        shape = (self.name, tuple(ids.shape), cache.width, options["last_only"], options["keep_hidden"])
        vocab = options["vocab"]
        key = (id(self), *shape, self.generation, None if vocab is None else tuple(vocab.tolist()))

        def forward(ids, positions, allowed, dest, rows):
            cache.plan(dest, cache.width, None, rows=rows)
            return self.model_forward(ids, Feed(positions, allowed, cache), **options)

        inputs = [
            ids,
            feed.positions,
            feed.allowed,
            cache.dest,
            cache.rows.expand_as(cache.dest).contiguous(),
        ]
        logits, hidden = self.graphs.run(key, shape, forward, inputs)
        return logits.clone(), None if hidden is None else hidden.clone()

    def _tree_logits(self, tokens, anc, depth, valid) -> torch.Tensor:
        raise ValueError(
            "shaped forwards (--deterministic, graphs) do not read token trees (the structure and finite "
            "twists, RACER): use another twist (--twist lookahead) or leave --deterministic off"
        )

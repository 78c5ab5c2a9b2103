"""A backend whose every forward has the shapes a request's rows would see alone: batch invariance.

A seeded request's output should not depend on its batch-mates, but the bits of a product do
depend on its shape: how many rows it has, how many positions per row, how many columns
attention reads. ``FixedShapeLM`` fixes all three for the rows of one request:

- rows: every forward runs ``FixedShape.rows`` rows (the rows held, then rows that are holes);
- columns: attention reads ``FixedShape.width`` columns, the cache's fixed capacity;
- positions: a forward's rows are grouped by their own count of fed tokens, each group run
  at the next power of two (``bucket``), the other rows holes; so a row's positions depend
  on what it is fed alone;
- prompts are prefilled one by one, each at its own length.

What a row computes then depends on itself and the shapes alone, not on where its
batch-mates put their tokens. It costs the rows (a CPU computes every hole) and a forward per
group. The CPU tricks, which shape forwards by what the rows hold, are off; token trees, whose
columns two groups would share before they are kept, are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import cpu
from .base import to_device
from .hf import HFBatchedLM


@dataclass(frozen=True)
class FixedShape:
    """The rows and attention columns of every forward of a fixed-shape backend."""

    rows: int = 64
    width: int = 1024

    def __post_init__(self) -> None:
        if self.rows < 1 or self.width < 2:
            raise ValueError(f"a fixed shape needs rows >= 1 and width >= 2, got {self.rows} x {self.width}")


def bucket(count: int) -> int:
    """The positions a row fed ``count`` tokens runs at: the next power of two."""
    return 1 << max(0, count - 1).bit_length()


class FixedShapeLM(HFBatchedLM):
    """``HFBatchedLM`` whose forwards have fixed shapes (``FixedShape``; see the module).

    Args:
        model: as ``HFBatchedLM``'s.
        shape: the rows and columns of every forward.
        **kwargs: ``HFBatchedLM``'s other arguments (its CPU tricks are off here).
    """

    def __init__(self, model: torch.nn.Module, shape: FixedShape, **kwargs) -> None:
        kwargs["tricks"] = cpu.NO_TRICKS
        super().__init__(model, **kwargs)
        if self.reads_hidden:
            raise ValueError("--deterministic cannot run a feature draft: its states are read in one block")
        self.shape = shape
        self.max_length = min(self.max_length, shape.width)  # the fixed width is the context now

    # Prompts: one by one, into rows of the one fixed-size cache.
    def _prefill(self, prompts: Sequence[Sequence[int]], hidden) -> torch.Tensor:
        if len(prompts) > self.shape.rows:
            raise ValueError(
                f"{self.name}: {len(prompts)} rows pass the fixed {self.shape.rows} (--deterministic)"
            )
        logits = [self._prefill_padded([prompts[0]], hidden)]
        return torch.cat(logits + [self._append([p]) for p in prompts[1:]])

    def _prefill_padded(self, prompts: Sequence[Sequence[int]], hidden) -> torch.Tensor:
        logits = super()._prefill_padded(prompts, hidden)
        self._pad_cache()
        return logits

    @torch.inference_mode()
    def _append(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Each prompt prefilled alone, its cache row copied into the next free row."""
        held = self.cache, self.lengths, self.bound, self.nonfinite, self.contents
        n = len(held[2])
        self._check_rows(n + len(prompts))
        logits = self._prefill(prompts, None)
        fresh = self.cache
        for mine, theirs in zip(held[0].layers, fresh.layers):
            mine.keys[n : n + len(prompts)] = theirs.keys[: len(prompts)]
            mine.values[n : n + len(prompts)] = theirs.values[: len(prompts)]
        self.cache = held[0]
        self.contents.held = held[4].held + self.contents.held
        self.lengths = torch.cat([held[1], self.lengths])
        self.bound = held[2] + self.bound
        self.nonfinite = self.nonfinite | held[3]
        return logits

    def _check_rows(self, n: int) -> None:
        if n > self.shape.rows:
            raise ValueError(f"{self.name}: {n} rows pass the fixed {self.shape.rows} (--deterministic)")

    def _pad_cache(self) -> None:
        """Give the cache its fixed rows and columns (once: later forks copy within them)."""
        rows, width = self.shape.rows, self.shape.width

        def padded(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(rows, t.shape[1], width, t.shape[3])
            out[: t.shape[0], :, : t.shape[2]] = t[:, :, :width]
            return out

        self.cache.map(padded)
        self.cache.capacity = width

    @torch.inference_mode()
    def fork(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows`` in order; the cache keeps its fixed rows (those past them stay as they are)."""
        if rows.numel() == 0:
            raise ValueError(f"{self.name}: fork() needs at least one row")
        if rows.numel() > self.shape.rows:
            raise ValueError(
                f"{self.name}: {rows.numel()} rows pass the fixed {self.shape.rows} (--deterministic)"
            )
        host = rows.tolist()
        physical = host + list(range(len(host), self.shape.rows))  # the rows past them: themselves
        used = max(self.bound, default=0)
        self.cache.fork(to_device(torch.tensor(physical), self.device), physical, used, self.shape.width)
        self.contents.fork(host, len(host))
        self.lengths = self.lengths.index_select(0, to_device(rows, self.device))
        self.bound = [self.bound[i] for i in host]
        self.tree_width = 0

    def reserve(self, rows: int, width: int) -> None:
        """The cache is allocated at its fixed width once; a forward needing more is refused."""
        if width > self.shape.width:
            raise ValueError(
                f"{self.name}: {width} positions pass the fixed width of {self.shape.width} (--deterministic)"
            )
        self._check_budget(self.shape.rows, self.shape.width)
        if self.cache.capacity < self.shape.width:  # a fresh cache: its layers come at this width
            self.cache.grow(self.shape.width)

    # Forwards: the fixed rows and columns, each row's positions by its own count.
    def _width(self, needed: int) -> int:
        return self.shape.width

    def _shaped(self, lengths: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        extra = self.shape.rows - len(lengths)
        return (
            torch.cat([lengths, lengths.new_zeros(extra)]),
            torch.cat([valid, valid.new_zeros(extra, valid.shape[1])]),
        )

    def _shaped_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([ids, ids.new_zeros(self.shape.rows - len(ids), ids.shape[1])])

    def _extend(self, tokens: torch.Tensor, valid, hidden, vocab) -> torch.Tensor:
        """A forward per group of rows fed like counts (by ``bucket``), each at its bucket's width."""
        r, t = tokens.shape
        valid = torch.ones(tokens.shape, dtype=torch.bool) if valid is None else valid.cpu()
        counts = valid.sum(1).tolist()
        out = None
        for width in sorted({bucket(c) for c in counts if c}):
            mine = torch.tensor([c and bucket(c) == width for c in counts])[:, None]
            ids = torch.zeros(r, width, dtype=tokens.dtype, device=tokens.device)
            fed = torch.zeros(r, width, dtype=torch.bool)
            keep = min(width, t)  # each row's real tokens are its last ones (left padding)
            ids[:, width - keep :] = tokens[:, t - keep :]
            fed[:, width - keep :] = valid[:, t - keep :] & mine
            vocab_on = None if vocab is None else to_device(vocab, self.device)
            logits = self._forward(ids, fed, last_only=False, vocab=vocab_on)  # [r, width, V]
            out = logits.new_zeros(r, t, logits.shape[-1]) if out is None else out
            at = to_device(mine[:, 0], out.device)
            out[at, t - keep :] = logits[at, width - keep :]
        if out is None:  # no row fed: nothing runs
            return torch.zeros(r, t, self.vocab_size if vocab is None else len(vocab), device=self.device)
        return out

    def _tree_logits(self, tokens, anc, depth, valid) -> torch.Tensor:
        raise ValueError(
            "--deterministic does not read token trees (the structure and finite twists, RACER): "
            "use another twist (--twist lookahead) or leave --deterministic off"
        )

"""A feed's forwards on a CPU: its real tokens alone (or one per count), rows holding the same tokens once.

A request's particles start as copies of one prompt, and every resampling copies rows again:
at a low temperature most rows of a population hold the same tokens for much of a run. Fed the
same tokens, such twins would compute the same logits and write the same cache columns, and on
a CPU a forward costs every row (and every position) it carries. So ``TwinFeeds`` runs a
left-padded feed over one row of each set of twins, its real tokens alone in one flattened
forward (``backends.ragged``; for a model that cannot, a forward per count of real tokens), and
copies the computed row's logits and new cache columns to its twins; what every row returns
and holds is unchanged. A token tree (``extend_tree``) is read over the rows that have nodes, one
row of each set of twins. ``RowContents`` tells twins apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import to_device
from .kv import on_host


class RowContents:
    """The token ids each row holds, in order (None where not known: after a tree read, say).

    Kept beside the cache by every operation that writes it: a forward appends what it fed, a
    fork copies, a rewind cuts. A row whose contents are not known is nobody's twin.
    """

    def __init__(self, rows: int = 0) -> None:
        self.held: list[tuple[int, ...] | None] = [()] * rows

    def fed(self, rows: Sequence[int], ids: torch.Tensor, valid: torch.Tensor) -> None:
        """Rows ``rows`` were fed ``ids [n, T]`` where ``valid`` (holes hold nothing)."""
        if not (on_host(ids) and on_host(valid)):  # reading them would be a sync: forget instead
            self.forget(rows)
            return
        for r, tokens, real in zip(rows, ids.tolist(), valid.tolist()):
            if self.held[r] is not None:
                self.held[r] += tuple(x for x, ok in zip(tokens, real) if ok)

    def kept(self, fed: Sequence[Sequence[int]], keep: torch.Tensor) -> None:
        """Each row kept the tree nodes ``keep [R, T]`` of the tokens ``fed [R][T]``, in order."""
        for r, (tokens, kept) in enumerate(zip(fed, keep.tolist())):
            if self.held[r] is not None:
                self.held[r] += tuple(x for x, k in zip(tokens, kept) if k)

    def fork(self, rows: list[int] | None, n: int) -> None:
        """Rows ``rows`` in order (None: given on the device, so ``n`` rows not known)."""
        self.held = [self.held[i] for i in rows] if rows is not None else [None] * n

    def drop(self, n: torch.Tensor) -> None:
        """Each row's last ``n[r]`` tokens are forgotten."""
        if not on_host(n):
            self.forget(range(len(self.held)))
            return
        self.held = [h if h is None else h[: len(h) - d] for h, d in zip(self.held, n.tolist())]

    def forget(self, rows: Sequence[int]) -> None:
        """What ``rows`` hold is no longer known."""
        for r in rows:
            self.held[r] = None

    def twins(
        self, rows: Sequence[int], fed: Sequence[Sequence[int]]
    ) -> tuple[list[int], list[int], list[int]]:
        """Of ``rows``, each about to be fed ``fed[i]``: the rows to compute, and each twin with its source.

        Returns ``(computed, twins, sources)``: ``twins[j]`` holds what ``sources[j]`` (a computed
        row) holds and is fed the same, so its forward would be the same.
        """
        first: dict[tuple, int] = {}
        computed, twins, sources = [], [], []
        for r, f in zip(rows, fed):
            key = None if self.held[r] is None else (self.held[r], tuple(f))
            if key in first:
                twins.append(r)
                sources.append(first[key])
                continue
            if key is not None:
                first[key] = r
            computed.append(r)
        return computed, twins, sources


class TwinFeeds:
    """``HFBatchedLM``'s forward of a left-padded feed: one per count of real tokens, twins once.

    The host owns ``contents`` (a ``RowContents``), ``shares_twins``, ``stats``, ``cache``,
    ``lengths``, ``bound``, ``device``, ``_forward(ids, valid, last_only=, rows=)`` and
    ``_tree_forward(tokens, anc, depth, width, rows)``.
    """

    def _grouped(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        groups: list[tuple[int, torch.Tensor]],
        flat: bool = False,
    ) -> torch.Tensor:
        """A forward per group of rows (each ``(width, rows)``: their real tokens are their last ``width``).

        ``flat``: each forward runs its rows' real tokens alone (``backends.ragged``).

        Of rows that hold the same tokens and are fed the same (``RowContents.twins``), one runs
        and the others take its logits and its new cache columns.
        """
        r, t = tokens.shape
        out, calls = None, self.stats.calls
        for width, rows in groups:
            ids, real = tokens[rows, t - width :], valid[rows, t - width :]
            shared = self.contents.twins(rows.tolist(), _real(ids, real)) if self.shares_twins else None
            computed, twins, sources = shared or (rows.tolist(), [], [])
            run = torch.tensor(computed) if twins else rows
            every = len(run) == r  # every row, in order: no subset to gather
            logits = self._forward(
                tokens[run, t - width :],
                valid[run, t - width :],
                last_only=False,
                rows=None if every else run,
                flat=flat,
            )
            if every and width == t:  # the whole feed, as it came
                return logits
            out = logits.new_zeros(r, t, logits.shape[-1]) if out is None else out
            out[run.to(out.device), t - width :] = logits  # holes stay 0: no caller reads them
            if twins:
                count = dict(zip(rows.tolist(), real.sum(1).tolist()))
                for n in sorted({count[s] for s in sources}):  # twins are fed alike: one count a pair
                    pairs = [(d, s) for d, s in zip(twins, sources) if count[s] == n]
                    self._copy_twins([d for d, _ in pairs], [s for _, s in pairs], n)
                out[twins, t - width :] = out[sources, t - width :]
        self.stats.calls, self.stats.split = calls + 1, self.stats.split + len(groups) - 1  # one extend
        return out

    def _tree_rows(
        self, tokens: torch.Tensor, anc: torch.Tensor, depth: torch.Tensor, width: int, counts: torch.Tensor
    ) -> torch.Tensor:
        """One tree forward over the rows that read a node (``counts [R]``, their first nodes real).

        Of rows that hold the same tokens and read the same tree, one runs; the others take its
        logits and the columns it wrote (the tree's, which ``keep_path`` settles for each row).
        """
        r, t = tokens.shape
        reading = (counts > 0).nonzero(as_tuple=True)[0]
        trees = torch.cat([tokens[reading], anc[reading].flatten(1)], 1)
        computed, twins, sources = self.contents.twins(reading.tolist(), trees.tolist())
        run = torch.tensor(computed)
        n = int(counts[run].max())
        if len(run) == r and n == t:  # the whole tree, as it came
            return self._tree_forward(tokens, anc, depth, width, None)
        logits = self._tree_forward(tokens[run, :n], anc[run, :n, :n], depth[run, :n], width, run)
        out = logits.new_zeros(r, t, logits.shape[-1])
        out[run, :n] = logits  # padding nodes and rows with none stay 0: no caller reads them
        if twins:
            dest, src = torch.tensor(twins), torch.tensor(sources)
            self.cache.copy_columns(dest, src, self.lengths.index_select(0, src)[:, None] + torch.arange(n))
            out[dest, :n] = out[src, :n]
        return out

    @torch.inference_mode()
    def _copy_twins(self, twins: list[int], sources: list[int], count: int) -> None:
        """Rows ``twins`` take the ``count`` cache columns ``sources`` just wrote; they hold the same."""
        dest, src = to_device(torch.tensor(twins), self.device), to_device(torch.tensor(sources), self.device)
        start = self.lengths.index_select(0, src) - count
        self.cache.copy_columns(dest, src, start[:, None] + torch.arange(count, device=self.device))
        self.lengths = self.lengths.index_add(0, dest, torch.full_like(dest, count))
        for d, s in zip(twins, sources):
            self.bound[d] = self.bound[s]
            self.contents.held[d] = self.contents.held[s]


def _real(ids: torch.Tensor, valid: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens (a host read of the ids: only where twins are looked for)."""
    return [[x for x, ok in zip(a, b) if ok] for a, b in zip(ids.tolist(), valid.tolist())]


def feed_groups(valid: torch.Tensor, row_cost: float) -> list[tuple[int, torch.Tensor]] | None:
    """Rows of a left-padded feed grouped by count of real tokens, each group a forward.

    A forward costs one read of the weights (1) and ``row_cost`` per row-position it carries:
    rows fed 9 tokens and rows fed 1 run apart, rows fed 2 and 1 together (padded to 2).
    Returns ``(width, rows)`` per forward, ``rows`` in order; None where no row is fed, or the
    holes do not all come first; rows with no real token are in no group.
    """
    if not on_host(valid):
        return None
    t = valid.shape[1]
    counts = valid.sum(1)
    if not torch.equal(valid, torch.arange(t)[None, :] >= (t - counts)[:, None]):
        return None
    distinct = sorted(set(counts.tolist()) - {0})
    if not distinct:
        return None
    sizes = [int((counts == c).sum()) for c in distinct]
    return [
        (distinct[j - 1], torch.isin(counts, torch.tensor(distinct[i:j])).nonzero(as_tuple=True)[0])
        for i, j in _cheapest_runs(distinct, sizes, row_cost)
    ]


def _cheapest_runs(counts: list[int], sizes: list[int], row_cost: float) -> list[tuple[int, int]]:
    """The cheapest split of ascending ``counts`` (``sizes[i]`` rows each) into consecutive runs.

    A run ``(i, j)`` of counts i..j-1 is one forward padded to count j-1: it costs 1 +
    ``row_cost`` x its rows x that count. Returns the runs in order.
    """
    n = len(counts)
    best, start = [0.0] + [math.inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + 1 + row_cost * sum(sizes[i:j]) * counts[j - 1]
            if cost < best[j]:
                best[j], start[j] = cost, i
    runs, j = [], n
    while j:
        runs.append((start[j], j))
        j = start[j]
    return runs[::-1]


def tree_counts(valid: torch.Tensor) -> torch.Tensor | None:
    """Each row's count of tree nodes, where every row's nodes come first (padding after); else None."""
    if not on_host(valid):
        return None
    counts = valid.sum(1)
    if not torch.equal(valid, torch.arange(valid.shape[1])[None, :] < counts[:, None]) or not counts.any():
        return None
    return counts

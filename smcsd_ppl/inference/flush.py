"""A block flush's per-row numbers: uniforms, temperatures and processing of the target, by backend row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..backends.base import to_device
from ..verification.processing import RowSampling, processed
from .blocks import BlockRequest, DraftedBlock
from .rows import RowStore
from .streams import RowPlan, RowStreams


@dataclass(frozen=True)
class Flush:
    """A block flush's per-row numbers: uniforms ``[R, K+2]`` and temperatures ``[R]`` by backend row.

    ``k``: the most any row drafts (each request's own K: requests of other K share the flush).
    ``greedy``: ``[R]`` rows at T_t = 0, whose logits are read at T = 1 (the argmax is the same).
    ``by_row``: the rows' processing of the target (None: no row's request sets any), and
    ``checks [R, K]`` the uniforms their drafted tokens are checked with.
    """

    uniforms: torch.Tensor
    target_t: torch.Tensor
    draft_t: torch.Tensor
    plans: list[RowPlan]  # by request
    k: int
    greedy: torch.Tensor
    by_row: RowSampling | None = None
    checks: torch.Tensor | None = None
    checked: frozenset[int] = frozenset()  # the rows of requests that process the target

    @property
    def any_greedy(self) -> bool:
        """Whether some row of the flush is greedy."""
        return bool(self.greedy.any())

    @classmethod
    def of(cls, store: RowStore, requests: Sequence[BlockRequest], k: int, streams: RowStreams) -> Flush:
        """The numbers of a flush of ``requests``, each drafting up to its K (``k`` where it has none)."""
        rows = [r.row for r in requests]
        temps = torch.ones(2, store.n_rows, dtype=torch.float32)
        greedy = torch.zeros(store.n_rows, dtype=torch.bool)
        for r in rows:
            plan = streams.plans[r]
            temps[0, r], temps[1, r] = plan.target_temperature or 1.0, plan.draft_temperature
            greedy[r] = plan.target_temperature == 0
        plans = [streams.plans[r] for r in rows]
        k = max((p.block_size or k for p in plans), default=k)
        # A row's draws are hashes of their purpose, whatever the width: K's of others change none.
        u = streams.table(store.n_rows, rows, k + 2)
        processing = {r: p.sampling for r, p in zip(rows, plans) if p.sampling is not None}
        if not processing:
            return cls(u, temps[0], temps[1], plans, k, greedy)
        settings = [processing.get(r) for r in range(store.n_rows)]
        by_row = RowSampling.of(settings, store.target.vocab_size, store.device)
        checks = streams.checks(store.n_rows, list(processing), k)
        return cls(u, temps[0], temps[1], plans, k, greedy, by_row, checks, frozenset(processing))

    def check(self, drafted: Sequence[DraftedBlock], k: int) -> None:
        """Give checks to the blocks of rows whose requests process the target.

        The target then checks each drafted token as speculative decoding does (``checked_retrieval``).
        """
        for b in drafted:
            if b.checks is None and b.row in self.checked:
                b.checks = self.checks[b.row, :k].tolist()

    def temper(self, logits: torch.Tensor, rows: Sequence[int], in_place: bool = False) -> torch.Tensor:
        """Raw ``logits [n, ..., V]`` of backend ``rows`` as the target's law reads them (processed).

        ``in_place``: ``logits`` are the caller's to overwrite.
        """
        t = self.target_t[rows].to(logits.device)
        return processed(logits, t, to_device(torch.tensor(rows), logits.device), self.by_row, in_place)

    def request(self, i: int, request: BlockRequest) -> BlockRequest:
        """Request ``i`` as its plan says: its draft length, proposal, K and EOS."""
        plan = self.plans[i]
        size = plan.block_size or self.k
        return replace(request, limit=plan.limit, block_size=size, stops_at_eos=plan.stops_at_eos)

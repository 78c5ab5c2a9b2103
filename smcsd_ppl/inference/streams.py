"""Each request's own random numbers, whoever shares its cycles.

A batched draw takes one uniform per row. Were those uniforms drawn from one generator for
the whole batch, a request's tokens would depend on which requests shared its cycles and
in what order. Here every uniform is a hash of the request's seed, the cycle, the
particle's slot and context, how many blocks the row was served this cycle, the purpose
(lead, draft position j, bonus) and nothing else: a request alone and the same request in
any batch draw the same numbers. Hashes of distinct keys behave as independent uniforms.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..config import Sampling
from ..keys import derive, mix64
from ..proposals.blocks import RowProposal

LEAD, BONUS, DRAFT = 1, 2, 3  # purposes; DRAFT + j is draft position j
CHECK = 1 << 20  # CHECK + j: the check of draft position j against a processed target


def row_key(seed: int, cycle: int, slot: int, context: int) -> int:
    """The key of one context row of one particle slot of a request in one cycle."""
    return derive(seed, "row", cycle, slot, context)


def uniform(key: int, purpose: int) -> float:
    """The uniform in [0, 1) of ``key`` for ``purpose`` (53 bits, as a float64 holds)."""
    return (mix64(key ^ _purpose_key(purpose)) >> 11) / float(1 << 53)


def block_uniforms(key: int, width: int) -> list[float]:
    """A block's uniforms for a row of ``key``: its lead, ``width - 2`` draft positions, its bonus."""
    return [uniform(key, p) for p in (LEAD, *(DRAFT + j for j in range(width - 2)), BONUS)]


@functools.cache
def _purpose_key(purpose: int) -> int:
    return mix64(purpose)


@dataclass(frozen=True)
class RowPlan:
    """What a step decided for one row: its draft length, its draws' key, its temperatures, its proposal.

    ``kind``: what the row's particle drafts from this cycle (``"target"``: nothing);
    ``proposal``: a retrieval or mixture row's ``RowProposal`` (None: the draft model's);
    ``block_size``: its request's K (0: the run's); ``stops_at_eos``: its request ends at EOS
    (not ``ignore_eos``); ``sampling``: its request's processing of the target (None: none).
    Rows of requests of other K and EOS settings share a cycle.
    """

    limit: int
    key: int
    target_temperature: float
    draft_temperature: float
    kind: str = "draft"
    proposal: RowProposal | None = None
    block_size: int = 0
    stops_at_eos: bool = True
    sampling: Sampling | None = None


class RowStreams:
    """The uniforms of one step's rows; a row served twice in a step draws afresh the second time."""

    def __init__(self, plans: Mapping[int, RowPlan]) -> None:
        self.plans = plans
        self.served: dict[int, int] = {}
        self.keys: dict[int, int] = {}  # each row's key for its latest service

    def table(self, n_rows: int, rows: Sequence[int], width: int) -> torch.Tensor:
        """Uniforms ``[n_rows, width]`` (float64, host) for a block flush of ``rows``.

        Column 0 is the lead's, 1..width-2 the draft positions', the last the bonus's; rows
        not asked are zeros. Each asked row's count of services moves on.
        """
        u = torch.zeros(n_rows, width, dtype=torch.float64)
        table = []
        for r in rows:
            n = self.served.get(r, 0)
            self.served[r] = n + 1
            self.keys[r] = mix64(self.plans[r].key ^ n)
            table.append(block_uniforms(self.keys[r], width))
        if rows:
            u[list(rows)] = torch.tensor(table, dtype=torch.float64)
        return u

    def checks(self, n_rows: int, rows: Sequence[int], k: int) -> torch.Tensor:
        """The uniforms ``[n_rows, k]`` (float64, host) each of ``rows``' drafted tokens is checked with.

        They belong to the service ``table`` last drew, and are independent of its draws.
        """
        u = torch.zeros(n_rows, k, dtype=torch.float64)
        if rows and k:
            checks = [[uniform(self.keys[r], CHECK + j) for j in range(k)] for r in rows]
            u[list(rows)] = torch.tensor(checks, dtype=torch.float64)
        return u

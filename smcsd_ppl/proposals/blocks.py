"""SMC-SD's proposals: what draws a row's block, and the log q its weight divides by.

A row's block comes from one of:

* ``"draft"``: the draft model q (one draft forward per position);
* ``"retrieval"``: the n-grams of the request's prompt and of what its particles wrote. The
  target checks each retrieved token x drawn from r as speculative decoding does: it keeps x
  with chance min(1, p(x) / r(x)) and, at the first it refuses, draws the bonus from the
  residual (p - r)+ instead. Every token so emitted follows p exactly, so the block weighs
  what the target alone would (log Z per token: nothing at alpha = 1 without a constraint);
  no draft forward runs;
* ``"mixture"``: q = (1 - w) r + w q_draft with ``w = DRAFT_SHARE`` (the draft's forwards);
* the target alone: a draft length of 0.

Where retrieval knows no continuation, or a constraint forbids all it knows, the block ends
there and the target draws the bonus: a rule that reads the prefix only. Each particle is
weighed by its own proposal (p / q of the q that drew it), so particles of one request may use
different ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .retrieval import NGramIndex

KINDS = ("draft", "retrieval", "mixture")
"""What one row's block may be drawn from (besides the target alone)."""
USES_DRAFT = {"draft": True, "retrieval": False, "mixture": True}

DRAFT_SHARE = 0.25  # mixture: the draft's share, which gives q full support
MIN_MATCH = 2  # the shortest context suffix whose continuations retrieval uses
# The shortest suffix match that makes the schedule try retrieval for a request of N weighted
# particles: two tokens recur in any text ("of the"), four rarely unless the output is copying.
# A plain request retrieves with one row, which costs little: it tries from MIN_MATCH.
PROBE_MATCH = 4
NGRAM = 10  # the longest n-gram indexed (RACER's)


class RequestIndex:
    """The n-grams of one request: its prompt, then every particle's tokens as they come.

    Shared by a request's particles and fed between cycles only, so within a cycle every
    proposal it gives depends on earlier cycles alone (an adaptive proposal stays proper).
    """

    def __init__(self, prompt: Sequence[int]) -> None:
        self.index = NGramIndex(NGRAM, max_nodes=10**7)
        self.index.feed([], [int(t) for t in prompt])

    def feed(self, before: Sequence[int], new: Sequence[int]) -> None:
        """Add the n-grams that ``new`` completes after a fed context ``before``."""
        if new:
            active = self.index.suffixes(self.index.match(before), 1)[::-1]  # shortest first
            self.index.feed(active, [int(t) for t in new])

    def continues(self, context: Sequence[int], min_match: int = MIN_MATCH) -> bool:
        """Whether retrieval knows a next token after ``context``'s last ``min_match`` tokens or more."""
        return self.index.continuations(self.index.match(context), min_match) is not None


@dataclass(frozen=True)
class RowProposal:
    """What draws one row's next block: a kind of ``KINDS``, its request's index and the row's tokens."""

    kind: str
    index: RequestIndex | None = None
    history: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a row's proposal must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "draft" and self.index is None:
            raise ValueError(f"a {self.kind} proposal needs its request's retrieval index")

    @property
    def uses_draft(self) -> bool:
        """Whether the draft model runs for this row."""
        return USES_DRAFT[self.kind]

    def then(self, tokens: Sequence[int]) -> RowProposal:
        """The same proposal after ``tokens`` joined the row (a lead, tokens sent since)."""
        return RowProposal(self.kind, self.index, (*self.history, *tokens)) if tokens else self


class Retrieval:
    """Retrieval along the blocks of one drafting call: its rows' walks, where they end, their r.

    Args:
        proposals: per request, its ``RowProposal`` (None: the draft).
        rows: per request, its backend row.
        vocab_size: V.
    """

    def __init__(self, proposals: Sequence[RowProposal | None], rows: Sequence[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.walks: dict[int, tuple[int, NGramIndex, object]] = {}  # request -> (row, index, node)
        self.kinds: dict[int, str] = {}
        for i, (p, r) in enumerate(zip(proposals, rows)):
            if p is not None and p.kind != "draft":
                self.walks[i] = (r, p.index.index, p.index.index.match(p.history))
                self.kinds[i] = p.kind
        self.ended_at: dict[int, int] = {}  # request -> position where retrieval knew nothing
        self.checks: dict[int, list[float]] = {}  # request -> the uniform of its check at each position
        self.known: dict[int, tuple] = {}  # id(node) -> (node, its continuations): the index is fixed

    def requests(self, kind: str) -> list[int]:
        """The requests of one kind (``"retrieval"`` or ``"mixture"``)."""
        return [i for i, k in self.kinds.items() if k == kind]

    def _found(self, i: int) -> dict[int, float] | None:
        """What retrieval knows after request ``i``'s context (rows share nodes: cached per call)."""
        _, index, node = self.walks[i]
        key = id(node)
        if key not in self.known:
            self.known[key] = (node, index.continuations(node, MIN_MATCH))
        return self.known[key][1]

    def _dense(self, items: list[int], found: list[dict[int, float]], device: torch.device) -> torch.Tensor:
        """Retrieval's distributions ``[len(items), V]`` from their sparse forms, in one write."""
        at = [(n, t, p) for n, f in enumerate(found) for t, p in f.items()]
        r = torch.zeros(len(items), self.vocab_size, device=device)
        if at:
            n, t, p = zip(*at)
            r[list(n), list(t)] = torch.tensor(p, device=device)
        return r

    def advance(self, tokens: list[int]) -> None:
        """Every walk reads its row's token at this position (``tokens`` per backend row)."""
        for i, (row, index, node) in self.walks.items():
            self.walks[i] = (row, index, index.step(node, tokens[row]))

    def mix_into(self, q: torch.Tensor) -> None:
        """Mixture rows: q ``[R, V]`` becomes (1 - w) r + w q in place where retrieval knows something."""
        items = [(i, f) for i in self.requests("mixture") if (f := self._found(i)) is not None]
        if items:
            rows = torch.tensor([self.walks[i][0] for i, _ in items], device=q.device)
            r = self._dense([i for i, _ in items], [f for _, f in items], q.device)
            q[rows] = (1 - DRAFT_SHARE) * r + DRAFT_SHARE * q[rows]

    def retrieved(self, j: int, live: Sequence[bool], device: torch.device) -> tuple[list[int], torch.Tensor]:
        """Retrieval rows still drafting at position ``j`` and their r ``[n, V]``; the others end here.

        ``live`` marks the backend rows still drafting.
        """
        items, found = [], []
        for i in self.requests("retrieval"):
            if not live[self.walks[i][0]] or i in self.ended_at:
                continue
            f = self._found(i)
            if f is None:
                self.ended_at[i] = j
            else:
                items.append(i)
                found.append(f)
        return items, self._dense(items, found, device)

    def draw(self, items: list[int], r: torch.Tensor, u: torch.Tensor) -> tuple[list[int], list[float]]:
        """Retrieval rows' tokens from their (restricted) r ``[n, V]``, and their log r.

        ``u``: each item's uniform. Where u falls inside the drawn token's share of the CDF,
        rescaled, is a second uniform independent of the token: the target's check of the
        token reads it (``checks``).
        """
        if not items:
            return [], []
        cdf = torch.cumsum(r.double(), -1)
        spot = u.to(cdf) * cdf[:, -1]
        tokens = torch.searchsorted(cdf, spot[:, None], right=True)[:, 0].clamp_(max=r.shape[-1] - 1)
        upper = cdf.gather(1, tokens[:, None])[:, 0]
        mass = r.double().gather(1, tokens[:, None])[:, 0]
        check = ((spot - (upper - mass)) / mass).clamp(0.0, 1.0 - 2**-53)
        for i, c in zip(items, check.tolist()):
            self.checks.setdefault(i, []).append(c)
        return tokens.tolist(), (mass / cdf[:, -1]).log().tolist()

"""The one draft -> verify -> settle loop, and exact speculative sampling on it.

``SpeculativeLoop`` drafts K tokens per row, scores them in one fused target forward,
lets an injected accept rule decide, and settles both caches. Exact speculative
sampling (Leviathan/Chen) injects ``speculative_accept``; EASD injects its entropy-aware
rule; MineDraft is a schedule over two loops. SD is the baseline that keeps SMC-SD honest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..backends.base import to_device
from ..config import SMCConfig
from ..ends import row_ends
from ..inference.blocks import BlockRequest, DraftedBlock
from ..inference.drafting import draft_blocks, generator_draws
from ..inference.rows import RowStore
from ..results import Generation, SpeculativeInfo
from ..verification import sample_tokens, speculative_accept
from ..verification.sampling import tempered_probs
from .registry import RunContext, register

AcceptRule = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
"""``(target_probs [R, K+1, V], draft_probs [R, K, V], tokens [R, K], g) -> n_acc, next, vetoed``.

Each output is ``[R]``: ``n_acc`` the accepted prefix length, ``next`` the token after
it (residual, veto or bonus draw), ``vetoed`` whether the rule rejected a token the
plain test would keep.
"""


def exact_accept(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, tokens: torch.Tensor, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling's rule (``speculative_accept``); it never vetoes."""
    n_acc, nxt = speculative_accept(target_probs, draft_probs, tokens, g)
    return n_acc, nxt, torch.zeros_like(n_acc, dtype=torch.bool)


@dataclass
class SpeculativeRun:
    """Token ids and counts per request of one speculative call."""

    token_ids: list[list[int]]
    drafted: list[int]  # draft tokens proposed (the kept part of each block)
    accepted: list[int]  # draft tokens accepted
    vetoes: list[int]  # blocks the rule cut where the plain test would have accepted

    def acceptance(self, i: int | None = None) -> float:
        """Accepted / drafted tokens, of request ``i`` or of all requests."""
        if i is None:
            return sum(self.accepted) / max(1, sum(self.drafted))
        return self.accepted[i] / max(1, self.drafted[i])


class SpeculativeLoop:
    """One row per request on one row store: draft, then verify and settle, until every row ends.

    ``draft`` and ``verify`` are separate steps so a schedule (MineDraft) can draft
    one loop while it verifies another. The target is sampled itself, so ``alpha``
    plays no part (the method registry refuses alpha != 1).

    Args:
        store: the rows of the draft and the target.
        config: K, T_d, T_t, the budget and the seed.
        eos: EOS ids in force.
        accept: the accept rule.
    """

    def __init__(
        self, store: RowStore, config: SMCConfig, eos: Sequence[int], accept: AcceptRule = exact_accept
    ) -> None:
        self.store, self.config, self.eos, self.accept = store, config, set(int(e) for e in eos), accept
        self.g = torch.Generator(device=store.device).manual_seed(config.seed)
        self.outs: list[list[int]] = []
        self.rows: list[int] = []  # request index of each live row
        self.blocks: list[DraftedBlock] | None = None  # drafted, awaiting verification
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.vetoes: list[int] = []

    @property
    def live(self) -> bool:
        """Some request is still generating."""
        return bool(self.rows)

    @torch.inference_mode()
    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """Prefill both models and draw each request's first token from the target."""
        if not prompts:
            return
        n = len(prompts)
        logits = self.store.start(prompts, range(n))
        x0 = sample_tokens(logits, self.config.target_temperature, self.g).tolist()
        self.store.queue({i: [x] for i, x in enumerate(x0)})
        self.outs = [[x] for x in x0]
        self.drafted, self.accepted, self.vetoes = [0] * n, [0] * n, [0] * n
        self.rows = [i for i, x in enumerate(x0) if not row_ends(x, 1, self.config.max_new_tokens, self.eos)]
        self.store.fork(self.rows)

    def draft(self) -> None:
        """Draft the next block of every live row, within each request's budget."""
        c = self.config
        requests = [BlockRequest(i, c.max_new_tokens - len(self.outs[r])) for i, r in enumerate(self.rows)]
        self.blocks = draft_blocks(
            self.store,
            requests,
            block_size=c.block_size,
            temperature=c.draft_temperature,
            eos=self.eos,
            draws=generator_draws(self.g, self.store.n_rows, self.store.device),
            keep_probs=True,
        )

    @torch.inference_mode()
    def verify(self) -> None:
        """Score the drafted blocks in one target forward, apply the rule, settle the rows."""
        blocks = self.blocks
        rows = [b.row for b in blocks]
        logits, hidden = self.store.score(rows, torch.tensor([b.tokens for b in blocks]).view(len(rows), -1))
        target_probs = tempered_probs(logits, self.config.target_temperature)  # [R, K+1, V]
        draft_probs = torch.stack([b.draft_probs for b in blocks])  # [R, K, V]
        tokens = to_device(torch.tensor([b.tokens for b in blocks]), draft_probs.device)
        n_acc, nxt, vetoed = self.accept(target_probs, draft_probs, tokens, self.g)
        n_acc, nxt, vetoed = torch.stack([n_acc, nxt, vetoed.long()]).tolist()  # one host read
        for r, b, m, v in zip(self.rows, blocks, n_acc, vetoed):
            self.drafted[r] += b.limit
            self.accepted[r] += min(m, b.limit)
            self.vetoes[r] += int(v and m < b.limit)
        going = self._settle(blocks, n_acc, nxt, hidden)
        self.rows = [self.rows[i] for i in going]
        self.blocks = None

    def _settle(
        self, blocks: Sequence[DraftedBlock], n_acc: Sequence[int], nxt: Sequence[int], hidden
    ) -> list[int]:
        """Apply the verdicts: extend outputs, commit both caches, keep the live rows.

        Each row's output gets its accepted prefix, then ``nxt[i]`` (the residual, veto
        or bonus draw) unless the block itself ended the row. Returns the indices of the
        blocks whose rows go on; the store keeps exactly those rows, in that order.
        """
        self.store.check_finite()  # once per cycle, not per forward
        kept, nexts, going = [], [], []
        for i, (b, m, t) in enumerate(zip(blocks, n_acc, nxt)):
            out = self.outs[self.rows[i]]
            if m >= b.limit:  # everything up to the EOS / budget cut was accepted
                out.extend(b.countable)
                t = None if b.stops else t
                kept.append(b.limit)
            else:  # rejected at m (by SD or by a veto): t replaces d_{m+1}
                out.extend(b.tokens[:m])
                kept.append(m)
            if t is not None:
                out.append(t)
                if row_ends(t, len(out), self.config.max_new_tokens, self.eos):
                    t = None
            nexts.append(t)
            if t is not None:
                going.append(i)
        rows = [b.row for b in blocks]
        self.store.commit(rows, [b.tokens for b in blocks], kept, nexts, [b.fed for b in blocks], hidden)
        self.store.fork(going)
        return going

    def result(self) -> SpeculativeRun:
        """The outputs and counts so far."""
        return SpeculativeRun(self.outs, self.drafted, self.accepted, self.vetoes)


def speculative_sampling(
    store: RowStore,
    config: SMCConfig,
    eos: Sequence[int],
    prompts: Sequence[Sequence[int]],
    *,
    accept: AcceptRule = exact_accept,
    on_step: Callable[[int], None] | None = None,
) -> SpeculativeRun:
    """Speculative sampling, one row per prompt, K drafted tokens per cycle.

    With the default rule the output distribution equals the target's at T_t exactly.
    """
    loop = SpeculativeLoop(store, config, eos, accept)
    loop.start(prompts)
    while loop.live:
        loop.draft()
        loop.verify()
        if on_step is not None:
            on_step(max(len(o) for o in loop.outs))
    return loop.result()


@register("sd", samples_target=True)
def _sd(ctx: RunContext) -> list[Generation]:
    run = speculative_sampling(ctx.rows(), ctx.config, ctx.eos, ctx.prompts, on_step=ctx.on_progress)
    info = SpeculativeInfo(run.acceptance())  # of the whole call, as SD has always reported it
    return ctx.generations(run.token_ids, [info for _ in run.token_ids])

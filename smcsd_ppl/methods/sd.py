"""Exact speculative sampling on the block engine: the baseline that keeps SMC-SD honest."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..backends.base import check_finite
from ..inference.engine import BlockEngine, DraftedBlock
from ..results import Generation
from ..spec import speculative_accept
from .registry import register


@dataclass
class SpeculativeRun:
    """Token ids per request, and acceptance statistics."""

    token_ids: list[list[int]]
    target_calls: int
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens accepted

    @property
    def acceptance(self) -> float:
        """Accepted / drafted tokens."""
        return self.accepted / max(1, self.drafted)


def speculative_sampling(
    engine: BlockEngine,
    prompts: Sequence[Sequence[int]],
    *,
    on_step: Callable[[int], None] | None = None,
) -> SpeculativeRun:
    """Leviathan/Chen speculative sampling, one row per prompt, K drafted tokens per cycle.

    The output distribution equals the target's at T_t exactly; ``alpha`` must be 1.
    """
    cfg = engine.config
    if cfg.alpha != 1.0:
        raise ValueError("exact speculative sampling samples the target itself: alpha must be 1")
    x0, _ = engine.start(prompts, copies=1)
    outs = [[x] for x in x0]
    rows = [i for i, x in enumerate(x0) if x not in engine.eos and cfg.max_new_tokens > 1]
    engine.reorder(rows)
    calls, drafted, accepted = 1, 0, 0
    while rows:
        blocks = engine.draft_blocks(
            range(len(rows)), [cfg.max_new_tokens - len(outs[r]) for r in rows], keep_probs=True
        )
        target_probs = torch.softmax(engine.target_logits(blocks), -1)  # [R, K+1, V]
        draft_probs = torch.stack([b.draft_probs for b in blocks])  # [R, K, V]
        tokens = torch.tensor([b.tokens for b in blocks], device=draft_probs.device)
        n_acc, nxt = speculative_accept(target_probs, draft_probs, tokens, engine.g)
        n_acc, nxt = torch.stack([n_acc, nxt]).tolist()  # one host read for both
        calls += 1
        drafted += sum(b.kept for b in blocks)
        accepted += sum(min(n, b.kept) for b, n in zip(blocks, n_acc))
        going = settle(engine, blocks, n_acc, nxt, [outs[r] for r in rows])
        rows = [rows[i] for i in going]
        if on_step is not None:
            on_step(max(len(o) for o in outs))
    return SpeculativeRun(outs, calls, drafted, accepted)


def settle(
    engine: BlockEngine, blocks: Sequence[DraftedBlock], n_acc: Sequence[int], nxt: Sequence[int], outs
) -> list[int]:
    """Apply speculative verdicts: extend outputs, commit both caches, keep the live rows.

    ``outs[i]`` is the output list of ``blocks[i]``'s row (extended in place): its
    accepted prefix, then ``nxt[i]`` (the residual, veto or bonus draw) unless the
    block itself ended the row. Shared by exact SD, EASD and the MineDraft schedule.
    Returns the indices of the blocks whose rows go on; the engine keeps exactly
    those rows, in that order.
    """
    cfg = engine.config
    check_finite(engine.target, engine.draft)  # once per cycle, not per forward
    kept, nexts, going = [], [], []
    for i, (b, m, t) in enumerate(zip(blocks, n_acc, nxt)):
        out = outs[i]
        if m >= b.kept:  # everything up to the EOS / budget cut was accepted
            out.extend(b.kept_tokens)
            t = None if b.stops else t
            kept.append(b.kept)
        else:  # rejected at m (by SD or by a veto): t replaces d_{m+1}
            out.extend(b.tokens[:m])
            kept.append(m)
        if t is not None:
            out.append(t)
            if t in engine.eos or len(out) >= cfg.max_new_tokens:
                t = None
        nexts.append(t)
        if t is not None:
            going.append(i)
    engine.commit(blocks, kept, nexts)
    engine.reorder(going)
    return going


@register("sd", summary="exact speculative sampling (Leviathan et al.)")
def _sd(pair, ids, config, on_progress):
    run = speculative_sampling(pair.engine(config), ids, on_step=on_progress)
    return [Generation(pair.decode(t), t, "sd", None, acceptance=run.acceptance) for t in run.token_ids]

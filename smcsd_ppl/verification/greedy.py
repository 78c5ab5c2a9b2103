"""Greedy rows (T_t = 0): the target's law is the point mass on its argmax.

A drafted block is kept up to its first token off the argmax path and the bonus is the
argmax there: exact greedy speculative decoding. Every particle of a greedy request then
holds the same tokens and weight, so resampling changes nothing and the output is the
path AR greedy decoding takes, whatever the draft proposed.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .smcsd import BlockBatch, Verdict


def argmax_path(
    logits: torch.Tensor,  # [n, V] or [n, k+1, V]
    log_factor: torch.Tensor | None = None,  # the same shape: a constraint's log-weights (-inf: not allowed)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The restricted target's argmax at each place, and whether anything is allowed there.

    Under a constraint the greedy token is the likeliest allowed one (a weighted constraint's
    factor tilts the choice, as it tilts the target); ties go to the lowest token id.
    """
    scores = logits.float() if log_factor is None else logits.float() + log_factor
    best = scores.argmax(-1)
    return best, torch.isfinite(scores.gather(-1, best.unsqueeze(-1)).squeeze(-1))


def greedy_verdict(
    verdict: Verdict, logits: torch.Tensor, batch: BlockBatch, greedy: torch.Tensor
) -> Verdict:
    """``verdict`` with the ``greedy [R]`` rows' blocks checked against the argmax path instead.

    A greedy row keeps its drafted tokens while they are the argmax (up to its ``limit``); at
    the first that is not, the block ends early (``diverged``, as a cut) and the argmax is the
    bonus. Its weight is 0 (plus its lead's), or -inf where nothing is allowed.
    """
    idx = greedy.nonzero(as_tuple=True)[0]
    if not idx.numel():
        return verdict
    factor = None if batch.log_factor is None else batch.log_factor[idx]
    scores = logits[idx].float()
    if batch.critic_allowed is not None:  # a critic's target is p within what it allows
        scores = scores.masked_fill(~batch.critic_allowed[idx], -math.inf)
    best, allowed = argmax_path(scores, factor)  # [n, k+1]
    k = batch.tokens.shape[1]
    limit = batch.limit[idx]
    off = (batch.tokens[idx] != best[:, :k]) & (
        torch.arange(k, device=limit.device)[None, :] < limit[:, None]
    )
    refused = off.any(1)
    kept = torch.where(refused, off.float().argmax(1), limit) if k else limit
    stops, dead = batch.stops[idx] & ~refused, batch.dead[idx] & ~refused
    rows = torch.arange(len(idx), device=kept.device)
    has_bonus = ~stops & ~dead & allowed[rows, kept]
    log_w = batch.lead_log_w[idx].to(verdict.log_w.dtype).masked_fill(dead | (~stops & ~has_bonus), -math.inf)
    changes = dict(
        kept=kept,
        diverged=refused,
        stops=stops,
        dead=dead,
        bonus=best[rows, kept],
        has_bonus=has_bonus,
        bonus_log_z=torch.zeros_like(log_w),
        log_w=log_w,
    )
    return replace(verdict, **{name: _put(getattr(verdict, name), idx, v) for name, v in changes.items()})


def _put(old: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    out = old.clone()
    out[idx] = values.to(out.dtype)
    return out

"""Weight objectives: a draft trained on the variance of SMC-SD's importance weights.

SMC-SD weighs a drafted token x ~ q by p(x)/q(x) (p: the target, q: the draft). One such
increment has mean 1 and second moment sum_x p(x)^2/q(x) = 1 + chi^2(p || q); over a block
the log second moments add up, and a block's ESS / N is about one over its second moment.
The verify's quality cut decides which positions carry a weight at all: a position whose
D(p || q) exceeds the cut ends the block there, and the target draws its token. So:

- a kept position (D <= cut) costs its increment's variance, chi^2 (``chi2``);
- a cut position carries no weight but loses a token. It costs its Renyi-2 divergence
  log(1 + chi^2), whose gradient in the draft's logits, q - r with r ~ p^2/q, is bounded
  like the KL's q - p: it pulls q toward p (TV <= sqrt(chi^2) / 2, so Renyi-2 below
  log(1 + 4 cut^2) passes a TV cut) without letting a hopeless position, whose chi^2 may
  be 1e6, decide the step.

``renyi2`` costs every position its Renyi-2 divergence, the log second moment of its
increment; summed over a block's kept positions it is about the block's log(N / ESS).

The target is known through its top-k log-probs only (stored at T = 1). Both sides get one
remainder bucket for every other token (``buckets``). Merging tokens can only lower an
f-divergence, so at T = 1 the objective is a lower bound of the full-vocabulary one, equal
when the target's tail is shaped like the draft's; at other T the bucket's mass assumes
that shape too. All in log space: Renyi-2 = logsumexp(2 log p - log q).
"""

from __future__ import annotations

import math

import torch

from ..verification.smcsd import DIVERGENCES

OBJECTIVES = ("kl", "chi2", "renyi2")
# Above this chi^2 a kept position's cost goes on along its tangent in log(1 + chi^2): float32
# holds exp(Renyi-2) only up to e^88, and one wild position should not own the batch's gradient.
CHI2_CAP = 1e4


def buckets(
    logits: torch.Tensor,  # [P, V] the draft's logits
    top_ids: torch.Tensor,  # [P, k] the target's top-k ids
    top_logp: torch.Tensor,  # [P, k] their log-probs at T = 1
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs p_T and q_T on the top-k ids plus a bucket for the rest (``[P, k+1]``; none if k = V).

    The draft's bucket is its exact mass outside the top-k, summed by itself (no 1 - sum:
    no cancellation when the top-k holds nearly all of q). The target's is 1 - sum(top-k)
    at T = 1; at other T its mass depends on how it spreads, which the data does not keep,
    so it is taken to spread like the draft's (detached). That makes the bucket exact at
    every T when it does, and the objective zero when q = p.
    """
    z = logits.float() / temperature
    log_norm = z.logsumexp(-1, keepdim=True)
    top_p, top_q = top_logp.float(), z.gather(-1, top_ids) - log_norm
    if top_ids.shape[-1] == z.shape[-1]:
        return torch.log_softmax(top_p / temperature, -1), top_q
    tail_q = z.scatter(-1, top_ids, -torch.inf).logsumexp(-1, keepdim=True)  # log sum_tail e^(l/T)
    with torch.no_grad():
        rest = torch.log((1 - top_p.exp().sum(-1, keepdim=True)).clamp_min(0))  # -inf: no tail mass
        tail_q1 = tail_q  # log sum_tail e^l: at T = 1 the same sum
        if temperature != 1:
            tail_q1 = logits.float().scatter(-1, top_ids, -torch.inf).logsumexp(-1, keepdim=True)
        # sum_tail p^(1/T) for p = rest * q_1 / q_1(tail): (log rest - log sum_tail e^l) / T + tail_q
        tail_p = (rest - tail_q1) / temperature + tail_q
    log_p = torch.log_softmax(torch.cat([top_p / temperature, tail_p], -1), -1)
    return log_p, torch.cat([top_q, tail_q - log_norm], -1)


def renyi2(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Renyi-2, log sum_x p^2/q = log(1 + chi^2(p || q)), per row: the verify's own formula."""
    return DIVERGENCES["renyi2"](log_p.exp(), log_q.exp(), log_p, log_q)


def chi2_of(r: torch.Tensor) -> torch.Tensor:
    """chi^2 = exp(r) - 1 from Renyi-2 ``r``, going on along its tangent above ``CHI2_CAP``."""
    cap = math.log1p(CHI2_CAP)
    low = r.clamp(max=cap)
    return torch.expm1(low) + math.exp(cap) * (r - low)


def position_losses(
    log_p: torch.Tensor,  # [P, B] the target's bucketed log-probs
    log_q: torch.Tensor,  # [P, B] the draft's, same buckets
    objective: str,
    cut: float | None,
    divergence: str = "tv",
) -> torch.Tensor:
    """Each position's cost ``[P]``: see the module docstring (``cut=None``: every position is kept)."""
    r = renyi2(log_p, log_q)
    if objective == "renyi2":
        return r
    if objective != "chi2":
        raise ValueError(f"position_losses takes 'chi2' or 'renyi2', got {objective!r}")
    if cut is None:
        return chi2_of(r)
    # where the verify cuts (read on the buckets: at most the full divergence), without gradient
    with torch.no_grad():
        lq = log_q.detach()
        kept = DIVERGENCES[divergence](log_p.exp(), lq.exp(), log_p, lq) <= cut
    return torch.where(kept, chi2_of(r), r)


def weight_loss(
    logits: torch.Tensor,  # [P, V] the draft's logits at the scored positions
    top_ids: torch.Tensor,  # [P, k] the target's top-k ids there
    top_logp: torch.Tensor,  # [P, k] their log-probs at T = 1
    objective: str,
    *,
    temperature: float = 1.0,
    cut: float | None = 0.3,
    divergence: str = "tv",
) -> torch.Tensor:
    """The mean cost of the positions under ``objective`` (``chi2`` or ``renyi2``) at ``temperature``."""
    log_p, log_q = buckets(logits, top_ids, top_logp, temperature)
    return position_losses(log_p, log_q, objective, cut, divergence).mean()

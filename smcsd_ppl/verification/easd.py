"""Pure verification math of EASD (entropy-aware speculative decoding).

EASD adds one rule to exact speculative sampling (``verification.speculative_accept``): where
both models are uncertain (draft entropy H_q > tau_q and target entropy H_p > tau_p)
yet their top-n predictions largely agree ("uncertain agreement"), the drafted token
is rejected even if SD would accept it, and the replacement is drawn from the target
with the drafted token excluded. The rule trades exactness for reasoning quality, so
with it on the output no longer follows the target exactly.

Shapes: R rows, K drafted tokens per row, V vocabulary. Entropies are in nats.
"""

from __future__ import annotations

import torch

from .exact import residual_after
from .sampling import pick, sample_probs


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each distribution ``[..., V] -> [...]`` (0 log 0 = 0)."""
    return torch.special.entr(probs).sum(-1)


def topn_overlap(p: torch.Tensor, q: torch.Tensor, n: int) -> torch.Tensor:
    """|topn(p) ∩ topn(q)| / n for each pair of distributions ``[..., V] -> [...]``."""
    top_p, top_q = p.topk(n, -1).indices, q.topk(n, -1).indices  # [..., n]
    return (top_p[..., :, None] == top_q[..., None, :]).any(-1).float().mean(-1)


def uncertain_agreement(
    target_probs: torch.Tensor,  # [R, K, V] p at the drafted positions
    draft_probs: torch.Tensor,  # [R, K, V] q at the drafted positions
    *,
    tau_q: float,
    tau_p: float,
    top_n: int,
    overlap: float,
) -> torch.Tensor:
    """EASD's veto ``[R, K]``: H_q > tau_q, H_p > tau_p and top-n overlap >= ``overlap``."""
    assert target_probs.shape == draft_probs.shape, (target_probs.shape, draft_probs.shape)
    uncertain = (entropy(draft_probs) > tau_q) & (entropy(target_probs) > tau_p)
    if not bool(uncertain.any()):  # the usual case: skip two top-n passes over V
        return uncertain
    return uncertain & (topn_overlap(target_probs, draft_probs, top_n) >= overlap)


def easd_accept(
    target_probs: torch.Tensor,  # [R, K+1, V] p at drafted positions and the bonus position
    draft_probs: torch.Tensor,  # [R, K, V] q at drafted positions
    drafts: torch.Tensor,  # [R, K]
    veto: torch.Tensor,  # [R, K] bool, from ``uncertain_agreement``
    g: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling with EASD's veto.

    d_j is accepted while u_j < p(d_j) / q(d_j) and it is not vetoed. At an SD
    rejection the next token comes from the residual norm(max(0, p - q)); at a veto
    of a token SD accepted, from p with d_j removed and renormalized; after a fully
    accepted block, the bonus from p. It draws exactly the random numbers
    ``speculative_accept`` draws, so with no veto both give the same tokens.

    Returns:
        n_accepted ``[R]``, the token that follows the accepted prefix ``[R]``, and
        whether the block was cut by the veto (an entropy rejection) ``[R]``.
    """
    r, k = drafts.shape
    p_d = pick(target_probs[:, :k], drafts)
    q_d = pick(draft_probs, drafts)
    # A token the target is certain of cannot be excluded (nothing would be left).
    veto = veto & (p_d < 1.0)
    u = torch.rand(r, k, generator=g, device=drafts.device)
    sd_ok = u * q_d < p_d  # u < p/q without dividing by a zero q
    n_acc = torch.cumprod((sd_ok & ~veto).long(), dim=1).sum(1)  # [R]
    rows = torch.arange(r, device=drafts.device)
    p_next, residual = residual_after(target_probs, draft_probs, n_acc)
    # Cut by the veto: SD accepted the token at n_acc, so the residual does not apply.
    pad = torch.zeros_like(sd_ok[:, :1])
    vetoed = torch.cat([sd_ok & veto, pad], 1)[rows, n_acc]  # [R]
    d_next = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], 1)[rows, n_acc]
    without_d = p_next.scatter(-1, d_next[:, None], 0.0)
    table = torch.where(vetoed[:, None], without_d, residual)
    return n_acc, sample_probs(table, g), vetoed

"""Exact speculative sampling (Leviathan et al.; Chen et al.): accept, or draw from the residual.

Shapes: R rows, K drafted tokens per row, V vocabulary.
"""

from __future__ import annotations

import torch

from .sampling import pick, sample_probs


def speculative_accept(
    target_probs: torch.Tensor,  # [R, K+1, V] p at drafted positions and the bonus position
    draft_probs: torch.Tensor,  # [R, K, V] q at drafted positions
    drafts: torch.Tensor,  # [R, K]
    g: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling: accept drafted tokens, then draw the residual or the bonus.

    Accepts d_j while u_j < p(d_j) / q(d_j); at the first rejection draws from the residual
    norm(max(0, p - q)), otherwise draws the bonus token from p.

    Returns:
        n_accepted ``[R]`` and the token that follows the accepted prefix ``[R]``.
    """
    r, k = drafts.shape
    p_d = pick(target_probs[:, :k], drafts)
    q_d = pick(draft_probs, drafts)
    u = torch.rand(r, k, generator=g, device=drafts.device)
    accept = u * q_d < p_d  # u < p/q without dividing by a zero q
    n_acc = torch.cumprod(accept.long(), dim=1).sum(1)  # [R] length of the accepted prefix
    _, residual = residual_after(target_probs, draft_probs, n_acc)
    return n_acc, sample_probs(residual, g)


def residual_after(
    target_probs: torch.Tensor,  # [R, K+1, V]
    draft_probs: torch.Tensor,  # [R, K, V]
    n_acc: torch.Tensor,  # [R] accepted prefix lengths
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p and the normalized residual max(0, p - q) after each accepted prefix.

    When all K were accepted q there is 0, so the residual is p itself (the bonus draw).
    Returns ``p_next [R, V]`` and ``residual [R, V]``.
    """
    rows = torch.arange(n_acc.shape[0], device=n_acc.device)
    p_next = target_probs[rows, n_acc]
    q_next = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], 1)[rows, n_acc]
    residual = torch.clamp(p_next - q_next, min=0.0)
    mass = residual.sum(-1, keepdim=True)
    return p_next, torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)

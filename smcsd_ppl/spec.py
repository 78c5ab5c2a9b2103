"""Pure verification math: SMC-SD block weights and exact speculative sampling.

Shapes: R rows (particles of all requests), K drafted tokens per row, V vocabulary.
All functions take float32 logits and return new tensors; nothing here holds state.
"""

from __future__ import annotations

import torch


def sample_tokens(logits: torch.Tensor, temperature: float, g: torch.Generator) -> torch.Tensor:
    """One token per row from softmax(logits / T) (``[R, V] -> [R]``)."""
    return sample_probs(torch.softmax(logits.float() / temperature, dim=-1), g)


def sample_probs(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One index per row of ``probs [R, V]`` (rows need not be normalized).

    Inverse CDF with one uniform per row: drawing V exponentials per row (the
    exponential race) costs ~10x more on CPU for a 49k vocabulary.
    """
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand(probs.shape[0], 1, generator=g, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def pick(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``table[r, k, tokens[r, k]]`` for ``table [R, K, V]``, ``tokens [R, K]`` -> ``[R, K]``."""
    return torch.gather(table, -1, tokens.unsqueeze(-1)).squeeze(-1)


def power_log_normalizer(logits: torch.Tensor, temperature: float, alpha: float) -> torch.Tensor:
    """Log sum_v p_T(v)^alpha for ``[..., V]`` logits (0 when alpha = 1).

    This is the weight of a token drawn from the normalized power p_T^alpha / Z.
    """
    scaled = logits.float() / temperature
    if alpha == 1.0:
        return torch.zeros(scaled.shape[:-1], device=scaled.device)
    return torch.logsumexp(alpha * scaled, -1) - alpha * torch.logsumexp(scaled, -1)


def block_log_weights(
    target_logp: torch.Tensor,  # [R, K] log p_T(d_j | .)
    draft_logq: torch.Tensor,  # [R, K] log q(d_j | .)
    kept: torch.Tensor,  # [R] number of drafted tokens that count (EOS or budget cut the rest)
    bonus_log_z: torch.Tensor,  # [R] log Z of the bonus position
    has_bonus: torch.Tensor,  # [R] bool: a bonus token is drawn after the block
    alpha: float,
) -> torch.Tensor:
    """SMC-SD incremental log-weight sum_{j<kept} [alpha log p - log q] + log Z_bonus (``[R]``)."""
    k = target_logp.shape[1]
    live = torch.arange(k, device=kept.device)[None, :] < kept[:, None]
    terms = torch.where(live, alpha * target_logp - draft_logq, torch.zeros_like(target_logp))
    return terms.sum(1) + torch.where(has_bonus, bonus_log_z, torch.zeros_like(bonus_log_z))


def speculative_accept(
    target_probs: torch.Tensor,  # [R, K+1, V] p at drafted positions and the bonus position
    draft_probs: torch.Tensor,  # [R, K, V] q at drafted positions
    drafts: torch.Tensor,  # [R, K]
    g: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling (Leviathan et al.; Chen et al.).

    Accepts d_j while u_j < p(d_j) / q(d_j); at the first rejection draws from the
    residual norm(max(0, p - q)), otherwise draws the bonus token from p.

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

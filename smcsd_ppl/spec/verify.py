"""Pure verification math: SMC-SD block weights and cuts, exact speculative sampling.

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


def _tv(p: torch.Tensor, q: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p - q).abs().sum(-1)


def _renyi2(p: torch.Tensor, q: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    # log E_q[(p/q)^2] = log(1 + chi^2(p || q)): the log second moment of one weight increment.
    return torch.logsumexp(torch.where(p > 0, 2 * log_p - log_q, -torch.inf), -1)


def _kl(p: torch.Tensor, q: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


DIVERGENCES = {"tv": _tv, "renyi2": _renyi2, "kl": _kl}
"""Divergences D(p || q) a block cut may use: total variation (in [0, 1]), Renyi-2 and KL (nats)."""


def cut_divergence(
    target_logits: torch.Tensor,  # [R, k, V] l / T_t at the drafted positions
    draft_probs: torch.Tensor,  # [R, k, V] q at the same positions (zero where a constraint forbids)
    alpha: float,
    name: str,
    restrict: torch.Tensor | None = None,  # [R] bool: compare with p restricted to q's support; None: no row
) -> torch.Tensor:
    """D(p^alpha / Z || q) at every drafted position (``[R, k]``).

    Where a proposal-mode constraint masks q, the target it stands for is p restricted to
    the allowed tokens; ``restrict`` marks those rows (q's support stands for the mask).
    """
    log_p = torch.log_softmax(alpha * target_logits.float(), -1)
    q = draft_probs.float()
    if restrict is not None:
        masked = log_p.masked_fill(q <= 0, -torch.inf)
        masked = masked - torch.logsumexp(masked, -1, keepdim=True)
        log_p = torch.where(restrict[:, None, None], masked, log_p)
    log_q = q.clamp_min(torch.finfo(q.dtype).tiny).log()
    return DIVERGENCES[name](log_p.exp(), q, log_p, log_q)


def first_cut(divergence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Where each block is cut (``[R]``): the first position whose divergence exceeds ``threshold``.

    ``divergence [R, k]`` describes the next-token distributions before each drafted token,
    so the cut depends on the prefix only, never on the token drawn where it falls: the
    bonus drawn from the target there keeps the block properly weighted. A block with no
    such position is cut at k (not at all).
    """
    over = divergence > threshold
    return torch.where(over.any(1), over.float().argmax(1), divergence.shape[1])


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

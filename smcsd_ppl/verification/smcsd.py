"""SMC-SD block verification: where each block is cut, its weight, and the bonus token.

``verify_blocks`` is the whole of it, one function over shaped tensors: R rows
(particles of all requests), k drafted tokens per row, V vocabulary. It holds no state;
the caller forwards the target, then commits what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import draw_restricted, inverse_cdf, logsumexp, pick, token_log_probs


def block_log_weights(
    target_logp: torch.Tensor,  # [R, K] log p_T(d_j | .)
    draft_logq: torch.Tensor,  # [R, K] log q(d_j | .)
    kept: torch.Tensor,  # [R] number of drafted tokens that count (EOS or budget cut the rest)
    bonus_log_z: torch.Tensor,  # [R] log Z of the bonus position
    has_bonus: torch.Tensor,  # [R] bool: a bonus token is drawn after the block
    alpha: float,
    log_factor: torch.Tensor | None = None,  # [R, K] a weighted constraint's log-weight of each d_j
) -> torch.Tensor:
    """SMC-SD incremental log-weight sum_{j<kept} [alpha log p + log w - log q] + log Z_bonus (``[R]``)."""
    k = target_logp.shape[1]
    live = torch.arange(k, device=kept.device)[None, :] < kept[:, None]
    log_p = alpha * target_logp if log_factor is None else alpha * target_logp + log_factor
    terms = torch.where(live, log_p - draft_logq, torch.zeros_like(target_logp))
    return terms.sum(1) + torch.where(has_bonus, bonus_log_z, torch.zeros_like(bonus_log_z))


def _tv(p: torch.Tensor, q: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p - q).abs().sum(-1)


def _renyi2(p: torch.Tensor, q: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    # log E_q[(p/q)^2] = log(1 + chi^2(p || q)): the log second moment of one weight increment.
    return logsumexp(torch.where(p > 0, 2 * log_p - log_q, -torch.inf), -1)


def _kl(p: torch.Tensor, q: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


DIVERGENCES = {"tv": _tv, "renyi2": _renyi2, "kl": _kl}
"""Divergences D(p || q) a block cut may use: total variation (in [0, 1]), Renyi-2 and KL (nats)."""


def cut_divergence(
    log_p: torch.Tensor,  # [..., V] log p^alpha / Z at drafted positions
    draft_probs: torch.Tensor,  # [..., V] q at the same positions (masked where a constraint forbids)
    name: str,
    log_factor: torch.Tensor | None = None,  # [..., V] a proposal constraint's factor; None: none
) -> torch.Tensor:
    """D(p^alpha / Z || q) at every drafted position given (``[...]``).

    Where a proposal-mode constraint masks q, the target it stands for is p^alpha times the
    constraint's factor (restricted to the allowed tokens, tilted by a weighted one's weights).
    """
    if log_factor is not None:
        tilted = log_p + log_factor
        tilted = tilted - logsumexp(tilted, -1, keepdim=True)
        # Rows without a factor stay exact; a dead end (nothing allowed) keeps p.
        partial = (log_factor != 0).any(-1, keepdim=True) & (log_factor > -torch.inf).any(-1, keepdim=True)
        log_p = torch.where(partial, tilted, log_p)
    q = draft_probs.float()
    p = torch.softmax(log_p, -1)  # exp(log p), renormalized: on a CPU softmax is ~3x faster than exp
    if name == "tv":  # TV reads no logarithm of q: a pass over the vocabulary fewer
        return _tv(p, q, log_p, q)
    log_q = q.clamp_min(torch.finfo(q.dtype).tiny).log()
    return DIVERGENCES[name](p, q, log_p, log_q)


def first_cut(divergence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Where each block is cut (``[R]``): the first position whose divergence exceeds ``threshold``.

    ``divergence [R, k]`` describes the next-token distributions before each drafted token,
    so the cut depends on the prefix only, never on the token drawn where it falls: the
    bonus drawn from the target there keeps the block properly weighted. A block with no
    such position is cut at k (not at all).
    """
    over = divergence > threshold
    return torch.where(over.any(1), over.float().argmax(1), divergence.shape[1])


@dataclass(frozen=True)
class BlockBatch:
    """R rows' drafted blocks of k tokens, as verification reads them (V: the vocabulary).

    Attributes:
        tokens: ``[R, k]`` drafted tokens.
        draft_logq: ``[R, k]`` log q of each (masked q where a constraint restricts).
        limit: ``[R]`` drafted tokens that may count: an EOS (kept), the budget, the draft
            length or a dead end.
        stops: ``[R]`` bool, the block ends the particle at ``limit`` (EOS or budget).
        dead: ``[R]`` bool, a constraint allowed nothing at position ``limit``.
        lead_log_w: ``[R]`` log mass the row's lead token was drawn from (0: no lead).
        draft_probs: ``[R, k, V]`` q at each drafted position, for the cut (None: no cut).
        log_factor: ``[R, k+1, V]`` a constraint's log-weights the target is tilted by (-inf:
            not allowed; the lead's, the kept tokens' and the bonus's); None: no row has one.
        critic_allowed: ``[R, k+1, V]`` bool, what a critic's hard constraint allows at each
            position: a bonus drawn from the whole target outside it vetoes the block; None: none.
        retrieved: ``[R]`` bool, the row's block was drawn by retrieval (``draft_logq`` then
            holds log r and ``draft_probs`` r): the target checks each token; None: no such row.
        checks: ``[R, k]`` float64, the uniform each retrieved token is checked with.
        log_tilt: ``[R, k+1, V]`` log Phi-hat where a row's tokens follow the structure read's
            tree, 0 elsewhere (``inference.structure``): q was drawn tilted by it, so the cut
            compares q with the target tilted alike, and the bonus is drawn tilted and weighs
            its tilt out. It is the proposal's, never the target's; None: no row has one.
    """

    tokens: torch.Tensor
    draft_logq: torch.Tensor
    limit: torch.Tensor
    stops: torch.Tensor
    dead: torch.Tensor
    lead_log_w: torch.Tensor
    draft_probs: torch.Tensor | None = None
    log_factor: torch.Tensor | None = None
    critic_allowed: torch.Tensor | None = None
    retrieved: torch.Tensor | None = None
    checks: torch.Tensor | None = None
    log_tilt: torch.Tensor | None = None


def _bonus(logits: torch.Tensor, alpha: float, batch: BlockBatch, kept: torch.Tensor, u: torch.Tensor):
    """Each row's bonus ``[R]`` from its ``logits [R, V]`` at ``kept``, and the log mass it weighs ``[R]``.

    Drawn from p^alpha times the constraint's factor and the structure's tilt; a tilted bonus
    weighs Z~ / Phi-hat(x b), as the lead does: the tilt is no part of the target.
    """
    rows = torch.arange(len(kept), device=kept.device)
    bonus, log_z = draw_restricted(logits, alpha, _factor_at(batch, rows, kept), u)
    if batch.log_tilt is not None:
        log_z = torch.where(torch.isfinite(log_z), log_z - batch.log_tilt[rows, kept, bonus], log_z)
    return bonus, log_z


def _factor_at(batch: BlockBatch, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """The constraint's log-factor plus the structure's tilt at (``rows``, ``positions``); None: neither."""
    parts = [x[rows, positions] for x in (batch.log_factor, batch.log_tilt) if x is not None]
    return sum(parts[1:], parts[0]) if parts else None


def checked_retrieval(
    log_p: torch.Tensor,  # [n, k, V] log p_T (alpha-free) at the drafted positions of the retrieved rows
    alpha: float,
    batch: BlockBatch,
    kept: torch.Tensor,  # [R] drafted tokens that may count
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the target refuses a retrieved token, the log q that weighs each, and the residual there.

    Retrieval drew token x from r; the target keeps it with chance min(1, p~(x) / r(x)) (p~:
    the target power times the constraint's factor, normalized) and at the first refusal the
    bonus comes from the residual (p~ - r)+, as in speculative decoding: each token emitted
    follows p~ exactly. Its log q is then log p~(x), so its weight is log Z there, what the
    target alone would earn. Returns the retrieved rows' ``kept`` (refused: the refusal's
    position), the drafted tokens' log q ``[R, k]`` and the residual ``[R, V]`` at ``kept``
    (the bonus is drawn from it where a token was refused). The other rows keep their blocks.
    """
    r, k = batch.tokens.shape
    first, logq = kept.clone(), batch.draft_logq.clone()
    residual = log_p.new_zeros(r, log_p.shape[-1])
    idx = batch.retrieved.nonzero(as_tuple=True)[0]
    if not idx.numel():
        return first, logq, residual
    tilted = alpha * log_p
    if batch.log_factor is not None:
        tilted = tilted + batch.log_factor[idx, :k]
    log_pt = tilted - torch.logsumexp(tilted, -1, keepdim=True)  # log p~ at each position
    log_pt_drafted = pick(log_pt, batch.tokens[idx])
    ratio = (log_pt_drafted - batch.draft_logq[idx]).exp().double()
    live = torch.arange(k, device=kept.device)[None, :] < kept[idx, None]
    refused = live & (batch.checks[idx] >= ratio)
    first[idx] = torch.where(refused.any(1), refused.float().argmax(1), kept[idx])
    at = first[idx].clamp(max=max(k - 1, 0))
    rows = torch.arange(idx.numel(), device=kept.device)
    residual[idx] = (log_pt[rows, at].exp() - batch.draft_probs[idx, at].float()).clamp_min(0)
    logq[idx] = log_pt_drafted
    return first, logq, residual


@dataclass(frozen=True)
class Verdict:
    """What verification decided for each row (every field ``[R]`` unless shaped otherwise).

    Attributes:
        kept: drafted tokens the target kept.
        diverged: the quality cut ended the block.
        stops: the block ends the particle (a drafted EOS or the budget): no bonus.
        dead: a constraint allowed nothing where the block ends: zero weight.
        target_logp: ``[R, k]`` alpha-free log p_T of each drafted token.
        bonus: the token drawn from the target after the kept prefix (where ``has_bonus``).
        has_bonus: a bonus token follows the kept prefix.
        bonus_log_z: log of the mass of p_T^alpha the bonus was drawn from (allowed tokens only;
            a tilted draw's tilt of the bonus taken out).
        log_w: the block's SMC-SD log-weight increment, its lead's included (-inf for a dead
            block, a row with no bonus to draw, or a critic's vetoed bonus).
    """

    kept: torch.Tensor
    diverged: torch.Tensor
    stops: torch.Tensor
    dead: torch.Tensor
    target_logp: torch.Tensor
    bonus: torch.Tensor
    has_bonus: torch.Tensor
    bonus_log_z: torch.Tensor
    log_w: torch.Tensor


def _read(logits: torch.Tensor, tokens: torch.Tensor, limit: torch.Tensor, padded: bool) -> tuple:
    """The drafted tokens' log p_T ``[R, k]``, and log p_T ``[M, V]`` where read (rows, positions).

    ``padded``: each row is read up to its ``limit`` only (vocabulary-wide passes over a batch's
    padding cost most of a cycle's verification), its other positions weigh nothing (0).
    """
    r, k = tokens.shape
    if padded:
        ri, ji = (torch.arange(k, device=logits.device)[None, :] <= limit[:, None]).nonzero(as_tuple=True)
        read = logits[ri, ji].float()
        target_logp = torch.zeros(r, k, device=logits.device)
        target_logp[ri, ji] = token_log_probs(read, tokens[ri, ji])
        return target_logp, torch.log_softmax(read, -1), (ri, ji)
    dense = logits[:, :k].float()
    ri = torch.arange(r, device=logits.device).repeat_interleave(k)
    read = (ri, torch.arange(k, device=logits.device).repeat(r))
    return token_log_probs(dense, tokens), torch.log_softmax(dense, -1).reshape(r * k, logits.shape[-1]), read


def _divergences(logits, log_p, read, batch: BlockBatch, alpha: float, name: str) -> torch.Tensor:
    """``cut_divergence`` where a cut can change the verdict, 0 elsewhere (``[R, k]``).

    ``log_p [M, V]``: log p_T at the positions ``read`` (rows, positions: each row's up to
    its ``limit``; the one at ``limit`` revives a dead block). Rows drawn by retrieval are left
    out: the target's own check decides those.
    """
    ri, ji = read
    if batch.retrieved is not None:
        asked = ~batch.retrieved[ri]
        ri, ji, log_p = ri[asked], ji[asked], log_p[asked]
    out = torch.zeros(batch.tokens.shape, device=logits.device)
    if ri.numel():
        power = log_p if alpha == 1.0 else torch.log_softmax(alpha * logits[ri, ji].float(), -1)
        factor = _factor_at(batch, ri, ji)
        out[ri, ji] = cut_divergence(power, batch.draft_probs[ri, ji], name, factor).float()
    return out


def verify_blocks(
    logits: torch.Tensor,  # [R, k+1, V] l / T_t at the drafted positions and after the last
    batch: BlockBatch,
    u: torch.Tensor,  # [R] the uniform each row's bonus is drawn with
    *,
    alpha: float = 1.0,
    cut: float | None = None,
    divergence: str = "tv",
    padded: bool = True,
) -> Verdict:
    """Cut each block, weigh it, and draw its bonus token from the (restricted) target power.

    ``padded``: rows are padded to the longest block, and only positions up to each row's
    ``limit`` are read (which reads the limits on the host); False: every position is read,
    with no host read, as the static path's graph needs (it runs no cut and no retrieval).

    The cut falls at the first position where D(p^alpha || q) exceeds ``cut`` (prefix only,
    so the weights stay proper); a dead block comes alive when the cut falls at or before
    the position that killed it, since the token there is dropped. Kept tokens weigh their
    ``log_factor`` too, and the bonus is drawn from p_T^alpha times the factor (restricted to
    allowed tokens), weighing the mass it was drawn from. A critic's bonus outside what its
    constraint allows gets zero weight. The lead token's mass adds to the block's weight.
    """
    tokens, log_factor = batch.tokens, batch.log_factor
    r, k = tokens.shape
    kept, diverged, stops, dead = batch.limit, torch.zeros_like(batch.stops), batch.stops, batch.dead
    target_logp, log_p, read = _read(logits, tokens, kept, padded)
    if cut is not None and k:
        at = first_cut(_divergences(logits, log_p, read, batch, alpha, divergence), cut)
        if batch.retrieved is not None:  # the target's own check decides where those end
            at = at.masked_fill(batch.retrieved, k)
        diverged = (at < kept) | (dead & (at == kept))
        kept = torch.where(diverged, at, kept)
        stops, dead = stops & ~diverged, dead & ~diverged
    draft_logq, refused = batch.draft_logq, None
    if batch.retrieved is not None and k:
        retrieved = logits[batch.retrieved.nonzero(as_tuple=True)[0], :k].float()
        first, draft_logq, residual = checked_retrieval(torch.log_softmax(retrieved, -1), alpha, batch, kept)
        refused = first < kept
        kept, stops, dead = torch.where(refused, first, kept), stops & ~refused, dead & ~refused
    rows = torch.arange(r, device=logits.device)
    bonus, bonus_log_z = _bonus(logits[rows, kept], alpha, batch, kept, u)
    if refused is not None:
        spare = residual.sum(-1) > 0  # none: p~ = r there, so only rounding refused; p~'s draw stands
        drawn = inverse_cdf(torch.where(spare[:, None], residual, torch.ones_like(residual)), u)
        bonus = torch.where(refused & spare, drawn, bonus)
    has_bonus = ~stops & ~dead & torch.isfinite(bonus_log_z)
    vetoed = torch.zeros_like(has_bonus)
    if batch.critic_allowed is not None:
        vetoed = has_bonus & ~batch.critic_allowed[rows, kept, bonus]
    drafted_factor = pick(log_factor[:, :k], tokens) if log_factor is not None else None
    log_w = block_log_weights(target_logp, draft_logq, kept, bonus_log_z, has_bonus, alpha, drafted_factor)
    log_w = (log_w + batch.lead_log_w).masked_fill(dead | (~stops & ~has_bonus) | vetoed, -torch.inf)
    has_bonus = has_bonus & ~vetoed
    return Verdict(kept, diverged, stops, dead, target_logp, bonus, has_bonus, bonus_log_z, log_w)

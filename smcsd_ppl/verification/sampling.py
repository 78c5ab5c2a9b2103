"""Drawing tokens and reading log-probabilities: the primitives every verifier shares.

Shapes: R rows, K positions, V vocabulary. Every stochastic function takes an explicit
``torch.Generator``; nothing here holds state.
"""

from __future__ import annotations

import math

import torch


def sample_tokens(logits: torch.Tensor, temperature: float, g: torch.Generator) -> torch.Tensor:
    """One token per row from softmax(logits / T) (``[R, V] -> [R]``); the argmax at T = 0."""
    if temperature == 0:
        return logits.argmax(-1)
    return sample_probs(torch.softmax(logits.float() / temperature, dim=-1), g)


def tempered_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) over the last axis; at T = 0 the point mass on the argmax (greedy)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits.float() / temperature, -1)


def tempered_log_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Each row's log softmax(logits / T) (``[n, V]``, ``[n]``); at T = 0 its argmax's point mass."""
    greedy = temperature == 0
    lp = torch.log_softmax(logits.float() / torch.where(greedy, 1.0, temperature)[:, None], -1)
    if bool(greedy.any()):
        point = torch.full_like(lp, -math.inf).scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
        lp = torch.where(greedy[:, None], point, lp)
    return lp


def sample_probs(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One index per row of ``probs [R, V]`` (rows need not be normalized).

    Inverse CDF with one uniform per row: drawing V exponentials per row (the
    exponential race) costs ~10x more on CPU for a 49k vocabulary.
    """
    u = torch.rand(probs.shape[0], generator=g, device=probs.device, dtype=probs.dtype)
    return inverse_cdf(probs, u)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index of each row of ``probs [R, V]`` where its CDF passes ``u [R]`` (uniforms in [0, 1)).

    Rows need not be normalized. Fixing ``u`` per output position makes a sampler's output
    independent of how many other draws it made (the rows a draft tree tried, say).
    """
    cdf = torch.cumsum(probs, dim=-1)
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def pick(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``table[r, k, tokens[r, k]]`` for ``table [R, K, V]``, ``tokens [R, K]`` -> ``[R, K]``."""
    return torch.gather(table, -1, tokens.unsqueeze(-1)).squeeze(-1)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The log softmax(logits)[tokens] (``[..., V]``, ``[...]`` -> ``[...]``), exact to its own scale.

    A near-certain token's log-probability is near 0, and a float32 sum near 1 cannot hold the
    mass beside it: ``torch.log_softmax`` leaves about 1e-5 in it over a 49k vocabulary, which
    moves with any reordering of the logits' products. Here the mass beside each token is summed
    apart: log p_t = -log1p(beside / p_t). A token whose p is not a normal float (over ~87 nats
    under the top, where beside / p_t could overflow) is read from its gap to the top instead.
    """
    p = torch.softmax(logits, -1)
    at = tokens.unsqueeze(-1)
    mine, top = p.gather(-1, at).squeeze(-1), p.amax(-1)
    beside = p.scatter_(-1, at, 0.0).sum(-1)  # p is ours to zero
    far = logits.gather(-1, at).squeeze(-1) - logits.amax(-1) + top.log()
    return torch.where(mine >= torch.finfo(p.dtype).tiny, -torch.log1p(beside / mine), far)


def drawn_log_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The log of ``probs[tokens]`` (``[R, V]``, ``[R]`` -> ``[R]``), exact to its own scale.

    As ``token_log_probs``, for a distribution already mixed or restricted (summing to 1): where
    a token holds most of it, log q_d = log1p(-the mass beside it, summed in float64).
    """
    mine = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    beside = probs.sum(-1, dtype=torch.float64) - mine
    return torch.where(mine > 0.5, torch.log1p(-beside), mine.log()).to(probs.dtype)


def logsumexp(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """``torch.logsumexp``, without its slow path on a CPU.

    torch's CPU exp slows about tenfold on arguments whose result is not a normal float (below
    about -87), which a vocabulary of logits at a low temperature is full of. A term that far
    under the largest weighs less than e^-80 each, under a float's resolution beside it even
    summed over a vocabulary, so it is read at e^-80. Rows of -inf stay -inf.
    """
    top = x.amax(dim, keepdim=True)
    shift = torch.where(torch.isinf(top), 0.0, top)
    out = torch.exp((x - shift).clamp_(min=-80.0)).sum(dim, keepdim=True).log_() + shift
    out = torch.where(torch.isinf(top), top, out)
    return out if keepdim else out.squeeze(dim)


def power_log_normalizer(logits: torch.Tensor, temperature: float, alpha: float) -> torch.Tensor:
    """Log sum_v p_T(v)^alpha for ``[..., V]`` logits (0 when alpha = 1).

    This is the weight of a token drawn from the normalized power p_T^alpha / Z.
    """
    scaled = logits.float() / temperature
    if alpha == 1.0:
        return torch.zeros(scaled.shape[:-1], device=scaled.device)
    return logsumexp(alpha * scaled, -1) - alpha * logsumexp(scaled, -1)


def restrict_power(
    power: torch.Tensor,  # [R, V] alpha * l / T_t
    log_z: torch.Tensor,  # [R] log sum_v p_T(v)^alpha
    log_factor: torch.Tensor | None,  # [R, V]: 0 or a constraint's log-weight; -inf: not allowed
) -> tuple[torch.Tensor, torch.Tensor]:
    """The power times a constraint's factor (a hard constraint: restricted), and the log mass kept.

    A row that allows nothing keeps its logits (so a draw stays defined) and gets a -inf mass:
    whatever it draws carries zero weight.
    """
    if log_factor is None:
        return power, log_z
    tilted = power + log_factor
    kept = logsumexp(tilted, -1) - logsumexp(power, -1)  # exactly 0 where the factor is 0
    none = ~(log_factor > -torch.inf).any(-1, keepdim=True)  # a comparison: isfinite is three
    return torch.where(none, power, tilted), log_z + kept


def draw_restricted(
    logits: torch.Tensor,  # [R, V] l / T_t where the token is drawn
    alpha: float,
    log_factor: torch.Tensor | None,  # [R, V] a constraint's log-weights (-inf: not allowed); None: none
    u: torch.Tensor,  # [R] a uniform per row
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from p_T^alpha times the factor, and the log mass drawn from (``[R]`` each).

    The lead token before a block and the bonus token after it are both drawn here; the
    mass is the token's weight (-inf where the factor allows nothing).
    """
    power, log_z = restrict_power(alpha * logits, power_log_normalizer(logits, 1.0, alpha), log_factor)
    return inverse_cdf(torch.softmax(power.float(), dim=-1), u.to(power.device)), log_z

"""Resampling schemes: normalized weights to ancestor indices.

Every resampling scheme maps normalized weights ``W`` (``[N]``, summing to 1)
and a ``torch.Generator`` to ancestor indices (``[N]``, int64). All but
residual resampling are one inverse-CDF lookup of differently drawn uniforms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .weights import normalize

Resampler = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # Sorted uniforms in [0, 1) -> indices. Dividing by the total puts the last live
    # particle's CDF at exactly 1, so a float sum below 1 never lets a uniform fall through
    # to the zero-weight (dead) particles after it, nor past the end.
    cdf = torch.cumsum(weights.double(), 0)
    return torch.searchsorted(cdf / cdf[-1], u.double(), right=True)


def _uniforms(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=g, dtype=torch.float64, device=g.device)


def multinomial(weights: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """N independent draws from Categorical(W)."""
    u, _ = torch.sort(_uniforms(weights.numel(), g))
    return _inverse_cdf(weights, u)


def stratified(weights: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One uniform draw in each of N equal strata of [0, 1)."""
    n = weights.numel()
    u = (torch.arange(n, dtype=torch.float64, device=g.device) + _uniforms(n, g)) / n
    return _inverse_cdf(weights, u)


def systematic(weights: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """N evenly spaced points with one shared random offset (lowest variance here)."""
    n = weights.numel()
    u = (torch.arange(n, dtype=torch.float64, device=g.device) + _uniforms(1, g)) / n
    return _inverse_cdf(weights, u)


def residual(weights: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """floor(N W_i) deterministic copies of each particle, the rest multinomial."""
    n = weights.numel()
    scaled = weights.double() * n
    copies = torch.floor(scaled).long()
    kept = torch.repeat_interleave(torch.arange(n, device=weights.device), copies)
    n_rest = n - kept.numel()
    if n_rest == 0:
        return kept
    rest = scaled - copies
    u, _ = torch.sort(_uniforms(n_rest, g))
    extra = _inverse_cdf(rest / rest.sum(), u)
    return torch.cat([kept, extra])


RESAMPLERS: dict[str, Resampler] = {
    "systematic": systematic,
    "multinomial": multinomial,
    "stratified": stratified,
    "residual": residual,
}


def resample(log_w: torch.Tensor, scheme: str, g: torch.Generator) -> torch.Tensor:
    """Ancestor indices ``[N]`` drawn from unnormalized log-weights ``[N]``."""
    if scheme not in RESAMPLERS:
        raise ValueError(f"unknown resampling scheme {scheme!r}; choose from {tuple(RESAMPLERS)}")
    return RESAMPLERS[scheme](normalize(log_w), g)

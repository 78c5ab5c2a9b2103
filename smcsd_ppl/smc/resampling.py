"""Resampling schemes: normalized weights to ancestor indices.

Every resampling scheme maps normalized weights ``W`` (``[N]``, summing to 1), a
``torch.Generator`` and a number of draws M to ancestor indices (``[M]``, int64): M = N
resamples, M = 1 selects one particle, M > N grows a population. All but residual
resampling are one inverse-CDF lookup of differently drawn uniforms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .weights import normalize

Resampler = Callable[[torch.Tensor, torch.Generator, int], torch.Tensor]


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # Sorted uniforms in [0, 1) -> indices. Dividing by the total puts the last live
    # particle's CDF at exactly 1, so a float sum below 1 never lets a uniform fall through
    # to the zero-weight (dead) particles after it, nor past the end.
    cdf = torch.cumsum(weights.double(), 0)
    return torch.searchsorted(cdf / cdf[-1], u.double(), right=True)


def _uniforms(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=g, dtype=torch.float64, device=g.device)


def multinomial_points(g: torch.Generator, m: int) -> torch.Tensor:
    """M sorted independent uniforms."""
    return torch.sort(_uniforms(m, g))[0]


def stratified_points(g: torch.Generator, m: int) -> torch.Tensor:
    """One uniform in each of M equal strata of [0, 1)."""
    return (torch.arange(m, dtype=torch.float64, device=g.device) + _uniforms(m, g)) / m


def systematic_points(g: torch.Generator, m: int) -> torch.Tensor:
    """M evenly spaced points with one shared random offset."""
    return (torch.arange(m, dtype=torch.float64, device=g.device) + _uniforms(1, g)) / m


POINTS: dict[str, Callable[[torch.Generator, int], torch.Tensor]] = {
    "systematic": systematic_points,
    "multinomial": multinomial_points,
    "stratified": stratified_points,
}
"""The schemes that are one inverse-CDF lookup of sorted points, by name (what a graph can run)."""


def multinomial(weights: torch.Tensor, g: torch.Generator, m: int) -> torch.Tensor:
    """M independent draws from Categorical(W)."""
    return _inverse_cdf(weights, multinomial_points(g, m))


def stratified(weights: torch.Tensor, g: torch.Generator, m: int) -> torch.Tensor:
    """One uniform draw in each of M equal strata of [0, 1)."""
    return _inverse_cdf(weights, stratified_points(g, m))


def systematic(weights: torch.Tensor, g: torch.Generator, m: int) -> torch.Tensor:
    """M evenly spaced points with one shared random offset (lowest variance here)."""
    return _inverse_cdf(weights, systematic_points(g, m))


def residual(weights: torch.Tensor, g: torch.Generator, m: int) -> torch.Tensor:
    """floor(M W_i) deterministic copies of each particle, the rest multinomial."""
    n = weights.numel()
    scaled = weights.double() * m
    copies = torch.floor(scaled).long()
    kept = torch.repeat_interleave(torch.arange(n, device=weights.device), copies)
    n_rest = m - kept.numel()
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


def resample(log_w: torch.Tensor, scheme: str, g: torch.Generator, m: int | None = None) -> torch.Tensor:
    """``m`` ancestor indices (default N) drawn from unnormalized log-weights ``[N]``."""
    if scheme not in RESAMPLERS:
        raise ValueError(f"unknown resampling scheme {scheme!r}; choose from {tuple(RESAMPLERS)}")
    return RESAMPLERS[scheme](normalize(log_w), g, log_w.numel() if m is None else m)

"""Log-space importance weights: cleaning, normalization, ESS and the log Z increment."""

from __future__ import annotations

import math

import torch


def clean_log_weights(log_w: torch.Tensor) -> torch.Tensor:
    """NaN log-weights become -inf (a dead particle); +inf is a bug and raises."""
    if torch.isposinf(log_w).any():
        raise ValueError(f"a log-weight is +inf: {log_w.tolist()}")
    return torch.nan_to_num(log_w, nan=-math.inf, posinf=math.inf, neginf=-math.inf)


def normalize(log_w: torch.Tensor) -> torch.Tensor:
    """Normalized weights W = exp(lw - logsumexp(lw)); uniform when all are -inf."""
    log_w = clean_log_weights(log_w.double())
    top = torch.max(log_w)
    if not torch.isfinite(top):
        return torch.full_like(log_w, 1.0 / log_w.numel())
    # Shift by the max, then divide: the heaviest term is exactly 1, so W sums to 1 even when
    # the log-weights are so large (1e30) that lw - logsumexp(lw) would lose the log N term.
    w = torch.exp(log_w - top)
    return w / w.sum()


ESS_SLACK = 1e-6
"""An ESS within this share below the threshold counts as at it. Identical particles put the ESS
exactly on the threshold (4 equal weights of 8 give 4.0), where float noise, one ulp from another
summation order, would decide alone; with the slack the eager and the compiled paths decide alike."""


def below_threshold(ess_value: float, n: int, threshold: float) -> bool:
    """Whether a population of ``n`` with this ESS resamples under ``threshold`` (a share of n)."""
    return n >= 2 and threshold > 0 and ess_value < threshold * n * (1 - ESS_SLACK)


def ess(log_w: torch.Tensor) -> float:
    """Effective sample size 1 / sum W^2 (N for uniform weights, 1 for one survivor), in [1, N]."""
    w = normalize(log_w)
    return min(max(float(1.0 / torch.sum(w * w)), 1.0), float(w.numel()))


def log_mean_exp(log_w: torch.Tensor) -> float:
    """log(mean(exp(lw))), the log Z increment of one resampling round."""
    log_w = clean_log_weights(log_w.double())
    return float(torch.logsumexp(log_w, 0) - math.log(log_w.numel()))

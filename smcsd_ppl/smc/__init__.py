"""Pure SMC math on log-weights (torch only): normalization, ESS, resampling."""

from .resampling import POINTS, RESAMPLERS, Resampler, multinomial, resample, residual, stratified, systematic
from .weights import ESS_SLACK, below_threshold, clean_log_weights, ess, log_mean_exp, normalize

__all__ = [
    "ESS_SLACK",
    "POINTS",
    "RESAMPLERS",
    "Resampler",
    "below_threshold",
    "clean_log_weights",
    "ess",
    "log_mean_exp",
    "multinomial",
    "normalize",
    "resample",
    "residual",
    "stratified",
    "systematic",
]

"""Pure SMC math on log-weights (torch only): normalization, ESS, resampling."""

from .resampling import RESAMPLERS, Resampler, multinomial, resample, residual, stratified, systematic
from .weights import clean_log_weights, ess, log_mean_exp, normalize

__all__ = [
    "RESAMPLERS",
    "Resampler",
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

"""Pure verification math (torch only): SMC-SD block weights and cuts, SD and EASD acceptance."""

from .verify import (
    DIVERGENCES,
    block_log_weights,
    cut_divergence,
    first_cut,
    pick,
    power_log_normalizer,
    residual_after,
    sample_probs,
    sample_tokens,
    speculative_accept,
)

__all__ = [
    "DIVERGENCES",
    "block_log_weights",
    "cut_divergence",
    "first_cut",
    "pick",
    "power_log_normalizer",
    "residual_after",
    "sample_probs",
    "sample_tokens",
    "speculative_accept",
]

"""Pure verification math (torch only): SMC-SD block verification, exact SD and EASD acceptance."""

from .exact import residual_after, speculative_accept
from .sampling import (
    draw_restricted,
    drawn_log_probs,
    inverse_cdf,
    pick,
    power_log_normalizer,
    restrict_power,
    sample_probs,
    sample_tokens,
    token_log_probs,
)
from .smcsd import (
    DIVERGENCES,
    BlockBatch,
    Verdict,
    block_log_weights,
    cut_divergence,
    first_cut,
    verify_blocks,
)

__all__ = [
    "DIVERGENCES",
    "BlockBatch",
    "Verdict",
    "block_log_weights",
    "cut_divergence",
    "draw_restricted",
    "drawn_log_probs",
    "first_cut",
    "inverse_cdf",
    "pick",
    "power_log_normalizer",
    "residual_after",
    "restrict_power",
    "sample_probs",
    "sample_tokens",
    "speculative_accept",
    "token_log_probs",
    "verify_blocks",
]

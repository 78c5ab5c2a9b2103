"""What a generation call returns: outputs and their cost."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParticleOut:
    """A finished particle."""

    token_ids: list[int]
    text: str
    log_weight: float


@dataclass
class RunStats:
    """Cost of one call (all its requests together).

    ``overhead_fraction`` is the share of wall time spent outside model forwards:
    sampling, weighting, resampling and Python bookkeeping.
    """

    method: str
    new_tokens: int
    seconds: float
    target_calls: int
    draft_calls: int
    target_seconds: float
    draft_seconds: float

    @property
    def tokens_per_second(self) -> float:
        """New tokens per wall-clock second."""
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """New tokens per target forward (prefill included)."""
        return self.new_tokens / max(1, self.target_calls)

    @property
    def overhead_fraction(self) -> float:
        """Share of wall time outside model forwards."""
        return (
            max(0.0, 1.0 - (self.target_seconds + self.draft_seconds) / self.seconds) if self.seconds else 0.0
        )


@dataclass
class Generation:
    """One request's output.

    Attributes:
        text: the generated continuation (the prompt excluded).
        token_ids: its token ids.
        method: the method's name (see ``smcsd_ppl.methods``).
        stats: the cost of the whole call this request was part of.
        log_z: SMC-SD only: the log normalizer estimate (see ``SMCResult``).
        n_resamples: SMC-SD only: resampling rounds.
        mean_ess: SMC-SD only: the mean of ``ess_trace``.
        particles: SMC-SD only: every final particle with its log-weight.
        ess_trace: SMC-SD only: the ESS before each cycle's resampling decision.
        acceptance: speculative methods (accepted / drafted tokens).
        entropy_rejections: EASD only (drafted tokens SD accepted but its rule rejected).
        message: why an output is empty, or incomplete (a constrained output cut short by
            ``max_new_tokens``), if it is.
        collapsed: SMC-SD only: the ESS averaged under ``inference.loop.COLLAPSE_ESS_FRACTION`` of
            the particles, so the output follows the draft more than the target (see
            ``SMCResult``).
        draft_lengths: SMC-SD with a quality cut: the draft length of each cycle (0: the
            target alone).
    """

    text: str
    token_ids: list[int]
    method: str
    stats: RunStats | None
    log_z: float | None = None
    n_resamples: int | None = None
    mean_ess: float | None = None
    acceptance: float | None = None
    entropy_rejections: int | None = None
    particles: list[ParticleOut] = field(default_factory=list)
    ess_trace: list[float] = field(default_factory=list)
    message: str = ""
    collapsed: bool = False
    draft_lengths: list[int] = field(default_factory=list)

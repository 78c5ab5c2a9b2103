"""What a generation call returns: outputs and their cost."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import DraftRecord


@dataclass
class ParticleOut:
    """A final particle: its output, and its log-weight (-inf: dead, never an output)."""

    token_ids: list[int]
    text: str
    log_weight: float

    @property
    def dead(self) -> bool:
        """A condition or a constraint gave this particle zero weight: its text is no output."""
        return self.log_weight == float("-inf")


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
class SMCInfo:
    """What SMC-SD reports of one request.

    Attributes:
        log_z: the log normalizer estimate (unbiased in Z; see docs/algorithm.md).
        particles: every final particle with its log-weight.
        ess_trace: the ESS before each cycle's resampling decision.
        particle_trace: the particles each cycle ran (N; 1 while a plain request decodes alone).
        mean_ess: the mean of ``ess_trace`` over the cycles that ran N >= 2 particles (the final
            weights' ESS when none did).
        n_resamples: resampling rounds.
        collapsed: the ESS averaged under ``inference.outcome.COLLAPSE_ESS_FRACTION`` of the
            particles, so the output follows the draft more than the target.
        draft_lengths: with a quality cut, the draft length of each cycle (0: the target alone).
        proposals: what proposed each of those cycles' blocks: ``draft`` (draft forwards),
            ``retrieval`` (copied from the prompt or the output: no forward), ``mixture``, or
            ``target`` (decoding alone); ``+`` joins those of particle groups that differ.
        draft_record: the record the request started from, with its own evidence added:
            pass it on (``SMCSD.draft_record``) to let later requests learn from this one.
        chosen: the index in ``particles`` of the one returned, drawn by weight (-1: none had
            a positive weight, and the output is empty).
    """

    log_z: float
    particles: list[ParticleOut]
    ess_trace: list[float]
    particle_trace: list[int]
    mean_ess: float
    n_resamples: int
    collapsed: bool = False
    draft_lengths: list[int] = field(default_factory=list)
    proposals: list[str] = field(default_factory=list)
    draft_record: DraftRecord = field(default_factory=DraftRecord)
    chosen: int = -1

    @property
    def alone(self) -> bool:
        """It ended decoding with the target alone: one particle, exact, so ``particles`` holds one.

        Only the plain program does (no constraint, no ``step`` of its own, alpha = 1); a program
        with conditions, potentials or a constraint keeps its N particles to the end.
        """
        return bool(self.particle_trace) and self.particle_trace[-1] == 1


@dataclass
class SpeculativeInfo:
    """What the speculative baselines (SD, EASD, MineDraft) report of one request.

    Attributes:
        acceptance: accepted / drafted tokens.
        entropy_rejections: EASD only: drafted tokens SD accepted but its rule rejected.
    """

    acceptance: float
    entropy_rejections: int | None = None


@dataclass
class Generation:
    """One request's output.

    Attributes:
        text: the generated continuation (the prompt excluded).
        token_ids: its token ids.
        method: the method's name (see ``smcsd_ppl.methods``).
        stats: the cost of the whole call this request was part of.
        message: why an output is empty, or incomplete (a constrained output cut short by
            ``max_new_tokens``), if it is.
        smc: SMC-SD's report (log Z, particles, ESS), for the SMC-SD methods.
        speculative: the speculative baselines' report (acceptance).
        finish_reason: why it ended: ``"stop"`` (a stop string), ``"eos"``, ``"length"`` (the
            budget), ``"constraint"`` (the constraint was complete), ``"cancelled"`` or
            ``"error"`` (``ends.FinishReason``).
        logprobs: where asked for, the target's log-probability of each token
            (``engine.scoring.TokenLogprob``), else None.
        prompt_logprobs: where asked for, the same of each prompt token after the first.
    """

    text: str
    token_ids: list[int]
    method: str
    stats: RunStats | None
    message: str = ""
    smc: SMCInfo | None = None
    speculative: SpeculativeInfo | None = None
    finish_reason: str = ""
    logprobs: tuple | None = None
    prompt_logprobs: tuple | None = None

    def to_record(self) -> dict:
        """A JSON-ready dict: the text, its cost and the method's report (particles left out)."""
        record: dict = {"text": self.text, "method": self.method, "new_tokens": len(self.token_ids)}
        record["finish_reason"] = str(self.finish_reason)
        s = self.stats
        if s is not None:
            record |= {
                "seconds": round(s.seconds, 5),
                "tokens_per_second": round(s.tokens_per_second, 3),
                "tokens_per_target_call": round(s.tokens_per_target_call, 4),
                "target_calls": s.target_calls,
                "draft_calls": s.draft_calls,
                "overhead_fraction": round(s.overhead_fraction, 3),
            }
        record["message"] = self.message
        smc, spec = self.smc, self.speculative
        if smc is not None:
            record |= {"n_resamples": smc.n_resamples, "mean_ess": smc.mean_ess, "log_z": smc.log_z}
            record |= {"collapsed": smc.collapsed, "draft_lengths": smc.draft_lengths}
            record |= {"proposals": smc.proposals}
        if spec is not None:
            record["acceptance"] = round(spec.acceptance, 3)
        return record


def generation(
    method: str,
    text: str,
    token_ids: list[int],
    stats: RunStats | None,
    reason: str,
    message: str = "",
    info: SMCInfo | SpeculativeInfo | None = None,
) -> Generation:
    """The one way a ``Generation`` is built: a method family's report goes to its field."""
    return Generation(
        text,
        list(token_ids),
        method,
        stats,
        message,
        smc=info if isinstance(info, SMCInfo) else None,
        speculative=info if isinstance(info, SpeculativeInfo) else None,
        finish_reason=str(reason),
    )

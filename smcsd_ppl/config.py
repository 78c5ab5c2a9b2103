"""Validated settings for SMC speculative decoding and the other methods."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

FORWARDS = ("auto", "compiled", "reference")
"""How a pair's models compute a forward (``models.batched.forward_of``): ``reference``, the model's own
(transformers: any model, the exactness reference); ``compiled``, ours (``backends.llama``), its parts
compiled now where not yet built; ``auto``, ours where the model runs on it, compiled where built."""
RESAMPLING_SCHEMES = ("systematic", "multinomial", "stratified", "residual")
SELECTIONS = ("sample", "argmax")
DIVERGENCE_NAMES = ("tv", "renyi2", "kl")  # see verification.DIVERGENCES
PROPOSAL_NAMES = ("auto", "draft", "retrieval", "mixture")  # see proposals.blocks
TWIST_NAMES = ("future-validity", "structure", "finite", "lookahead")  # see potentials.twist
AUTO_TWIST = "auto"  # each constraint's own twist (``Constraint.default_twist``)
# Below this, tempered log-probabilities (log p / T) grow past what float weights resolve: the ESS
# and the resampling of near-greedy particles stop meaning anything. Use selection="argmax" or
# the "ar" method at a low temperature instead.
MIN_TEMPERATURE = 0.01
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings.

    Attributes:
        top_k: keep the k likeliest tokens (0: all).
        top_p: keep the likeliest tokens whose mass reaches p (1: all).
        min_p: keep the tokens at least this fraction as likely as the likeliest (0: all).
        logit_bias: (token id, bias) pairs added to the logits before the temperature.
    """

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def active(self) -> bool:
        """Whether it changes the target at all."""
        return bool(self.top_k or self.top_p < 1 or self.min_p > 0 or self.logit_bias)

    def check(self, vocab_size: int | None = None) -> None:
        """Refuse (``ValueError``) settings out of range, naming the field."""
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: all tokens), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"logit_bias names token {token!r}, outside the vocabulary")
            if not math.isfinite(bias) and bias != -math.inf:
                raise ValueError(f"logit_bias of token {token} must be a number or -inf, got {bias!r}")


@dataclass(frozen=True)
class SMCConfig:
    """Settings of one SMC-SD run, shared by the API and the CLI.

    N and K are the reference implementation's fastest benchmark setting; the temperature is
    the one the default target's authors recommend (benchmarks set their own, usually 0.7);
    ``cut`` is the quality floor (``None`` runs the paper's algorithm unchanged).

    Attributes:
        n_particles: N, particles per request.
        block_size: K, the most tokens drafted per particle and cycle.
        ess_threshold: resample when ESS < threshold * N; 0 never resamples.
        resampling: one of ``RESAMPLING_SCHEMES``.
        draft_temperature: T_d of the proposal q.
        target_temperature: T_t of the target p; 0 is greedy: the target's argmax path, which
            SMC-SD returns exactly (a block is kept up to its first token off the path).
        alpha: power on the target (1 = the target itself; > 1 sharpens).
        selection: ``"sample"`` picks the output particle in proportion to its
            final weight, ``"argmax"`` picks the heaviest.
        max_new_tokens: generation budget per request.
        seed: seed of the run's ``torch.Generator``.
        ignore_eos: treat EOS as an ordinary token and emit exactly
            ``max_new_tokens`` (for speed measurements).
        cut: the quality floor: each drafted block is cut at the first position where
            the divergence between the target's and the draft's next-token distributions
            exceeds this, and the bonus token is drawn from the target there (the weights
            stay proper). Drafting then adapts to the kept lengths, down to decoding with
            the target alone where the draft does not pay. ``None``: the paper's algorithm
            (whole blocks, fixed N and K). In (0, 1] for ``"tv"``; any positive number of nats
            for ``"renyi2"`` and ``"kl"``.
        cut_divergence: the divergence ``cut`` bounds, one of ``DIVERGENCE_NAMES``.
        token_level: draft nothing: every block is one token drawn from the target (with its
            weight), which makes a program token-level SMC with the target as proposal, the
            baseline its blocks are measured against.
        proposal: what draws the blocks: ``"draft"`` (the draft model), ``"retrieval"``
            (n-grams of the prompt and of the output so far, mixed with the target: no draft
            forward), ``"mixture"`` (retrieval mixed with the draft model), or ``"auto"``: the
            draft schedule picks draft or retrieval per request and cycle by their recent pass
            rates (with ``cut=None``, the paper's algorithm, ``auto`` is the draft).
        twist: how a hard constraint's future validity Phi (the chance that a prefix can still
            be completed validly) guides SMC-SD, one of ``TWIST_NAMES``, None (off), or
            ``"auto"`` (the default): each constraint's own ``default_twist``, which is
            ``"finite"`` for a JSON schema and none for the others (``twist_on``).
            ``"future-validity"``: Phi exact by dynamic programming where the target's
            next-token law can be read for any context (a mock), which tilts the draft and
            the target's draws by it; elsewhere as ``"lookahead"``. ``"lookahead"``: a one-step
            estimate of Phi, the target's allowed mass after each block's end (one forward of
            one position, whose law the next block's first token is drawn from), as a LLaMPPL
            twist on the block's end. ``"structure"``: the same, read on through the finite
            structure after the end (where masks allow few tokens) in the same forward, which
            also tilts the next block's first token (``inference.structure``). ``"finite"``:
            the structure read only where every path it follows ends the output or the read
            (an enum's values, the rest of an object of enums); where the structure ahead opens
            into free text, no twist and no read. Either way
            the twist cancels at the end; it does nothing without a constraint.
        top_k, top_p, min_p, logit_bias: the processed target, as vLLM processes it (logit bias,
            then the temperature, then min-p, top-k and top-p): keep the k likeliest tokens (0:
            all), those whose mass reaches p (1: all), those at least min_p as likely as the
            likeliest (0: all); ``logit_bias`` holds (token id, bias) pairs. SMC-SD samples the
            processed target exactly (``verification.processing``).
    """

    n_particles: int = 8
    block_size: int = 8
    ess_threshold: float = 0.5
    resampling: str = "systematic"
    draft_temperature: float = 0.2
    target_temperature: float = 0.2
    alpha: float = 1.0
    selection: str = "sample"
    max_new_tokens: int = 128
    seed: int = 0
    ignore_eos: bool = False
    cut: float | None = 0.3
    cut_divergence: str = "tv"
    token_level: bool = False
    proposal: str = "auto"
    twist: str | None = AUTO_TWIST
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _check_int("n_particles", self.n_particles, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_int("seed", self.seed, 0)
        if self.seed > MAX_SEED:
            raise ValueError(f"seed must be at most 2**63 - 1, got {self.seed}")
        if not 0.0 <= self.ess_threshold <= 1.0:
            raise ValueError(f"ess_threshold must be in [0, 1], got {self.ess_threshold}")
        _check_positive("draft_temperature", self.draft_temperature)
        if self.draft_temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"draft_temperature must be at least {MIN_TEMPERATURE}, got {self.draft_temperature!r}"
            )
        if self.target_temperature != 0:
            _check_positive("target_temperature", self.target_temperature)
            if self.target_temperature < MIN_TEMPERATURE:
                raise ValueError(
                    f"target_temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, "
                    f"got {self.target_temperature!r}"
                )
        _check_positive("alpha", self.alpha)
        if self.resampling not in RESAMPLING_SCHEMES:
            raise ValueError(f"resampling must be one of {RESAMPLING_SCHEMES}, got {self.resampling!r}")
        if self.cut_divergence not in DIVERGENCE_NAMES:
            raise ValueError(f"cut_divergence must be one of {DIVERGENCE_NAMES}, got {self.cut_divergence!r}")
        if self.cut is not None:
            _check_positive("cut", self.cut)
            # TV lies in [0, 1], so a floor above 1 never cuts; Renyi-2 and KL are in nats, unbounded.
            if self.cut_divergence == "tv" and self.cut > 1:
                raise ValueError(
                    f"cut must be in (0, 1] for the tv divergence (it never exceeds 1), got {self.cut!r}"
                )
        if self.proposal not in PROPOSAL_NAMES:
            raise ValueError(f"proposal must be one of {PROPOSAL_NAMES}, got {self.proposal!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.twist not in (*TWIST_NAMES, AUTO_TWIST, None):
            raise ValueError(f"twist must be one of {TWIST_NAMES}, 'auto' or None, got {self.twist!r}")
        # A dict or pairs, as one hashable form: (token id, bias) pairs in token order.
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in pairs)))
        self.sampling.check()
        if self.twist not in (AUTO_TWIST, None) and self.ignore_eos:
            raise ValueError("a twist toward valid completions needs EOS: drop ignore_eos or the twist")

    @property
    def sampling(self) -> Sampling:
        """The target's processing this run asks for (top-k, top-p, min-p, logit bias)."""
        return Sampling(self.top_k, self.top_p, self.min_p, self.logit_bias)

    def twist_on(self, constraint) -> str | None:
        """The twist this run gives ``constraint``: ``twist``, or under ``"auto"`` the constraint's own.

        ``"auto"`` twists nothing without a constraint or with ``ignore_eos`` (a twist needs EOS).
        """
        if self.twist != AUTO_TWIST:
            return self.twist
        if constraint is None or self.ignore_eos:
            return None
        return getattr(constraint, "default_twist", None)


def paper_settings(config: SMCConfig) -> SMCConfig:
    """``config`` as the paper's SMC-SD runs it (``smcsd_paper``): no quality cut, the draft proposing."""
    return dataclasses.replace(config, cut=None, proposal="draft")


def available_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_threads(threads: int | None, name: str = "threads") -> None:
    """Refuse a CPU thread count below 1 or above the cores this process may use (None: unset)."""
    if threads is None:
        return
    cores = available_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= cores:
        raise ValueError(f"{name} must be between 1 and the {cores} CPU cores available, got {threads!r}")


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class DraftRecord:
    """What is known of a draft before a request starts, for SMC-SD's adaptive drafting.

    A value: requests start from it and never change it, so outputs do not depend on what
    ran before. Empty, requests probe the draft; a record saying the draft does not pay lets
    them decode with the target alone from their first token. A distilled draft ships one
    (``smcsd eval-draft --save-record``).

    Attributes:
        passed: drafted positions the quality cut kept.
        failed: cuts that fired.
        rates: ``(proposal, passed, failed)`` of the other proposals (``"retrieval"``,
            ``"mixture"``): positions kept and blocks that ended short, per particle.
        row_cost: r, one verified position of one row against one target step, for which the
            record's requests decide how far to draft; then every choice a request makes comes
            from the record and the request alone, and a seed gives the same answer on every
            machine. None: the machine's own estimate (``inference.schedule``).
    """

    passed: float = 0.0
    failed: float = 0.0
    rates: tuple[tuple[str, float, float], ...] = ()
    row_cost: float | None = None

    def __post_init__(self) -> None:
        counts = [("passed", self.passed), ("failed", self.failed)]
        if self.row_cost is not None:
            counts.append(("row_cost", self.row_cost))
        for kind, p, f in self.rates:
            if kind not in PROPOSAL_NAMES[2:]:
                raise ValueError(f"DraftRecord.rates names a proposal of {PROPOSAL_NAMES[2:]}, got {kind!r}")
            counts += [(f"rates[{kind}].passed", p), (f"rates[{kind}].failed", f)]
        for name, value in counts:
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"DraftRecord.{name} must be a finite number >= 0, got {value!r}")

    def rate_of(self, proposal: str) -> tuple[float, float]:
        """(passed, failed) of a proposal other than the draft; (0, 0) if unknown."""
        return next(((p, f) for k, p, f in self.rates if k == proposal), (0.0, 0.0))

    def as_json(self) -> dict:
        """The record as a JSON object (``from_json`` reads it back)."""
        return {"passed": self.passed, "failed": self.failed, "rates": [list(r) for r in self.rates]} | (
            {} if self.row_cost is None else {"row_cost": self.row_cost}
        )

    @classmethod
    def from_json(cls, obj: dict) -> DraftRecord:
        """A record from ``as_json``'s object (a ValueError for anything else)."""
        if not isinstance(obj, dict) or not set(obj) <= {"passed", "failed", "rates", "row_cost"}:
            raise ValueError(
                f"a draft record is an object of passed, failed, rates and row_cost, got {obj!r}"
            )
        try:
            rates = tuple((str(k), float(p), float(f)) for k, p, f in obj.get("rates", ()))
        except (TypeError, ValueError) as err:
            raise ValueError(f"a draft record's rates are [proposal, passed, failed] lists: {err}") from None
        return cls(obj.get("passed", 0.0), obj.get("failed", 0.0), rates, obj.get("row_cost"))


def checked_record(record: object) -> DraftRecord:
    """``record`` if it is a ``DraftRecord``; else a one-line ``ValueError`` saying what to pass."""
    if not isinstance(record, DraftRecord):
        raise ValueError(
            f"a draft record must be a DraftRecord (DraftRecord() for none), got {type(record).__name__}"
        )
    return record

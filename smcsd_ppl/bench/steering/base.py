"""What every steering runner shares: its record, its constraint, and how it picks its output."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ... import smc
from ...methods.registry import RunContext
from ...potentials import PotentialConstraint, RegexConstraint


@dataclass
class SteeringRecord:
    """One run of one method on one prompt.

    Attributes:
        text: the selected particle (EOS dropped); sampled by final weight.
        token_ids: the selected particle's tokens (EOS dropped).
        texts: every final particle's text (EOS dropped).
        particle_ids: every final particle's tokens (EOS dropped).
        lengths: tokens each particle generated, a final EOS included (it costs a step too).
        log_weights: final log-weight of each particle.
        valid: whether each final particle has positive weight and satisfies the
            constraint (``TaskConstraint.check``).
        chosen: index of the selected particle (-1 when every weight is zero).
        seconds: wall time of the SMC call.
        log_z: the method's log normalizer estimate (log marginal likelihood).
        ess: effective sample size of the final weights.
        target_calls: target forwards the method itself counted (SMC-SD runners).
        target_forwards: target forwards counted around the call (set by the comparison).
    """

    method: str
    text: str
    token_ids: list[int]
    texts: list[str]
    particle_ids: list[list[int]]
    lengths: list[int]
    log_weights: list[float]
    valid: list[bool]
    chosen: int
    seconds: float
    log_z: float | None = None
    ess: float | None = None
    message: str = ""
    target_calls: int | None = None
    target_forwards: int | None = None

    @property
    def validity(self) -> float:
        """Share of final particles that satisfy the constraint."""
        return sum(self.valid) / len(self.valid) if self.valid else 0.0

    @property
    def tokens(self) -> float:
        """Mean generated tokens per particle (a final EOS included)."""
        return float(np.mean(self.lengths)) if self.lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Tokens of one sequence per wall second (``tokens / seconds``)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def selected_valid(self) -> bool:
        """The returned text satisfies the constraint."""
        return self.chosen >= 0 and self.valid[self.chosen]


class TaskConstraint:
    """A regex or a genlm-control byte potential, in every form the runners need.

    Args:
        tokenizer: the target's tokenizer.
        eos_token_ids: the EOS ids (allowed once the text is complete).
        pattern: a regex (Python ``re`` syntax, matched against the whole stripped text)
            or a genlm-control ``Potential`` over bytes.
        meaning: what the text must also mean to count as valid (a real calendar date, JSON
            that parses into the schema), beyond the form the constraint enforces; None: form only.
    """

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], pattern, meaning=None) -> None:
        self.pattern, self.meaning = pattern, meaning
        self.regex = pattern if isinstance(pattern, str) else None
        if self.regex is not None:
            from genlm.control import BoolFSA

            self.tokens = RegexConstraint(pattern, tokenizer, eos_token_ids)
            self.potential = BoolFSA.from_regex(pattern)
        else:
            self.tokens = PotentialConstraint(pattern, tokenizer, eos_token_ids)
            self.potential = pattern

    def check(self, text: str) -> bool:
        """The whole (stripped) text satisfies the constraint, and means what it must."""
        text = text.strip()
        if self.regex is not None:
            ok = re.fullmatch(self.regex, text) is not None
        else:
            ok = asyncio.run(self.potential.complete(list(text.encode()))) > -math.inf
        return ok and (self.meaning is None or self.meaning(text))

    def allows(self, ids: Sequence[int]) -> bool:
        """The last token of ``ids`` is allowed after the ones before it."""
        return bool(self.tokens.next_mask([list(ids[:-1])])[0, ids[-1]])

    def mask(self, ids: Sequence[int]) -> set[int]:
        """Token ids allowed after ``ids``."""
        return set(torch.nonzero(self.tokens.next_mask([list(ids)])[0]).flatten().tolist())


def as_constraint(ctx: RunContext, constraint) -> TaskConstraint:
    """``constraint`` itself if it is a ``TaskConstraint``, else one built on the context's target."""
    if isinstance(constraint, TaskConstraint):
        return constraint
    return TaskConstraint(ctx.target_model.tokenizer, ctx.eos, constraint)


def finish(method, ctx, task, ids_per_particle, log_w, seconds, seed, lengths=None) -> SteeringRecord:
    """Drop EOS, decode, check, pick the output by final weight; log Z and ESS from ``log_w``."""
    eos = set(ctx.eos)
    lengths = [len(p) for p in ids_per_particle] if lengths is None else lengths
    ids = [[int(t) for t in p if int(t) not in eos] for p in ids_per_particle]
    texts = [ctx.decode(p) for p in ids]
    w = smc.clean_log_weights(torch.tensor(log_w, dtype=torch.float64))
    # A zero-weight particle is not an output, even if its (cut) text happens to match.
    valid = [bool(torch.isfinite(x)) and task.check(t) for x, t in zip(w, texts)]
    rec = SteeringRecord(method, "", [], texts, ids, lengths, w.tolist(), valid, -1, seconds)
    select(rec, w, seed)
    return rec


def select(rec: SteeringRecord, log_w: torch.Tensor, seed: int) -> None:
    """Sample the output particle by weight; set log Z (log-mean-exp) and ESS of ``log_w``."""
    if not torch.isfinite(log_w).any():
        rec.text, rec.token_ids, rec.chosen, rec.ess, rec.log_z = "", [], -1, 0.0, -math.inf
        rec.message = rec.message or "every particle has zero weight"
        return
    rec.ess, rec.log_z = float(smc.ess(log_w)), float(smc.log_mean_exp(log_w))
    g = torch.Generator().manual_seed(seed)
    rec.chosen = int(torch.multinomial(smc.normalize(log_w), 1, generator=g))
    rec.text, rec.token_ids = rec.texts[rec.chosen], rec.particle_ids[rec.chosen]


SteeringRunner = Callable[..., SteeringRecord]
"""A steering method: ``(ctx, prompt, constraint, **kw) -> SteeringRecord``."""

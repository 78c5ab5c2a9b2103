"""Adaptive drafting: how many tokens a request drafts next, learned from where its blocks were cut.

With the quality cut on (``SMCConfig.cut``), a block keeps its drafted tokens only while the
draft stays close to the target. Each request counts the drafted positions that passed the
cut and the cuts that fired, estimates the chance ``a`` that a position passes, and picks
the draft length L that maximizes the expected tokens per unit of cost:

    tokens(L) = 1 + a + a^2 + ... + a^L              (the kept prefix and the bonus token)
    cost(L)   = 1 + c L + r (n (L + 1) - 1)          (in one-token target steps)

where c is one draft forward's cost (the draft's share of the parameters) and r one verified
position of one row: the cycle's n rows (the particles) each verify L + 1 positions in the
fused forward, and the verify reads the whole vocabulary at each. r is small on an
accelerator, where the forward is memory-bound, and large on a CPU (``ROW_POSITION_COST``).

L = 0 is decoding with the target alone. A draft length depends only on earlier cycles,
so every block is still cut by a rule that sees its prefix only, and weights stay proper.

The plain program (no constraint, no conditions, alpha = 1) decodes alone, or from retrieval,
with one particle: the target checks every retrieved token (``proposals.blocks``), so the
weights of a cycle that runs no draft are all equal and more particles would buy nothing.
Every other request keeps its N particles throughout, and a plain request probes the draft
with all N (a probe's kept tokens carry weights like any block's).

A request starts from a ``DraftRecord``: what is known of the draft beforehand (none: it
probes). The record is a value the caller passes in, never state a request changes, so the
same call gives the same output whatever ran before; a finished request's evidence can be
folded into a new record (``learned``) by a caller who wants requests to learn.
Once a record says the draft does not pay, requests decode alone from their first token
without even prefilling the draft. A record that names its row cost r decides with it, not the
machine's: a seed then gets the same answer on every machine.

Proposals (``proposals.blocks``): the schedule may choose among several (``candidates``),
each with its own recent pass rate and cost (retrieval runs no draft forward: c = 0, only
the verified positions). Each cycle it runs the one with the most expected
tokens per unit of cost, or the target alone when none pays; proposals it knows nothing of yet
are probed side by side, the particles split among them. Retrieval is only tried where it knows
a continuation of some particle's context (a look that costs nothing), and its evidence fades
while it is not used, so a request probes it again later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..backends import cpu
from ..config import DraftRecord
from ..proposals.blocks import USES_DRAFT

PRIOR_POSITIONS = 8.0  # how many drafted positions a record counts for in a new request
MEMORY = 0.8  # a learned record keeps this share of its older evidence

# r: one verified position of one row relative to a one-token target step. On a 2-core CPU
# (the embedded pair, bf16 on AMX) a cycle of 8 rows verifying L = 0, 2, 4, 8 tokens took 1.35,
# 2.25, 3.19, 3.76 steps (docs/benchmarks.md, "What a cycle costs"): about 0.05 per
# row-position, as float32 on an AVX2 CPU. On an accelerator the forward is memory-bound and
# rows come almost free. A CPU that emulates bf16 declares its own, far dearer
# (``backends.cpu``).
ROW_POSITION_COST = {"cpu": cpu.NATIVE_ROW_POSITION_COST}
DEFAULT_ROW_POSITION_COST = 0.0025
RECENT = 0.85  # a retrieval or mixture pass rate keeps this share of its evidence per cycle
PROBE_BELOW = 1.0  # evidence (in positions) under which a proposal other than the draft is probed


def row_position_cost(device_type: str, declared: float | None = None) -> float:
    """r: one verified position of one row relative to a one-token target step.

    ``declared``: the target backend's own figure, which wins; else the device's.
    """
    return declared if declared is not None else ROW_POSITION_COST.get(device_type, DEFAULT_ROW_POSITION_COST)


def draft_step_cost(draft_params: int | None, target_params: int | None) -> float:
    """c: one draft forward relative to one target step, from the models' sizes.

    Decoding at small batch reads every weight once per forward, so a draft forward costs
    about its share of the parameters. Unknown sizes (test backends) count as a third.
    """
    return draft_params / target_params if draft_params and target_params else 1 / 3


def cycle_cost(length: int, rows: int, cost: float, row_cost: float) -> float:
    """A cycle's cost in one-token target steps: ``rows`` rows verifying ``length`` tokens each."""
    return 1 + cost * length + row_cost * (rows * (length + 1) - 1)


def expected_tokens(pass_rate: float, length: int) -> float:
    """Tokens a block of ``length`` gives when each position passes with ``pass_rate``: 1 + a + ... + a^L."""
    return sum(pass_rate**j for j in range(length + 1))


def best_length(pass_rate: float, cost: float, longest: int, rows: int = 1, row_cost: float = 0.0) -> int:
    """The draft length in [0, longest] with the most expected tokens per unit of cost.

    ``rows`` rows verify every drafted block; the target alone (length 0) runs as many.
    """

    def value(n: int) -> float:
        return expected_tokens(pass_rate, n) / cycle_cost(n, rows, cost, row_cost)

    return max(range(longest + 1), key=value)


def _scaled(passed: float, failed: float) -> tuple[float, float]:
    seen = passed + failed
    scale = min(1.0, PRIOR_POSITIONS / seen) if seen else 0.0
    return passed * scale, failed * scale


def schedule_from(
    record: DraftRecord,
    block_size: int,
    particles: int,
    plain: bool,
    cost: float,
    candidates: tuple[str, ...] = ("draft",),
    row_cost: float = DEFAULT_ROW_POSITION_COST,
) -> DraftSchedule:
    """A new request's schedule, starting from ``record`` (probing when it is empty).

    ``row_cost``: the machine's r, used where the record names none.
    """
    passed, failed = _scaled(record.passed, record.failed)
    others = tuple((k, *_scaled(*record.rate_of(k))) for k in candidates if k != "draft")
    return DraftSchedule(
        block_size,
        particles,
        plain,
        cost,
        passed,
        failed,
        passed,
        failed,
        candidates=candidates,
        others=others,
        row_cost=row_cost if record.row_cost is None else record.row_cost,
    )


def learned(record: DraftRecord, schedule: DraftSchedule) -> DraftRecord:
    """``record`` with a finished request's own evidence added, older evidence fading."""
    rates = {k: (p, f) for k, p, f in record.rates}
    for kind, passed, failed in schedule.others:  # recent rates: the request's last word
        old = record.rate_of(kind)
        rates[kind] = (MEMORY * old[0] + passed, MEMORY * old[1] + failed)
    return DraftRecord(
        MEMORY * record.passed + schedule.passed - schedule.prior_passed,
        MEMORY * record.failed + schedule.failed - schedule.prior_failed,
        tuple(sorted((k, p, f) for k, (p, f) in rates.items())),
        record.row_cost,
    )


@dataclass(frozen=True)
class DraftSchedule:
    """One request's draft length and particle count, cycle by cycle (a value: changes return new ones).

    Attributes:
        block_size: K, the longest block.
        particles: N, the particle count while drafting.
        plain: the request runs the plain program at alpha = 1, so it may decode alone with
            one particle.
        cost: c, one draft forward's cost relative to one target step.
        passed: drafted positions kept by the cut so far (the record's share included).
        failed: cuts that fired so far (likewise).
        prior_passed: the record's share of ``passed``.
        prior_failed: the record's share of ``failed``.
        lengths: the draft length of each cycle run (0: the target alone).
        candidates: the proposals the request may use (``proposals.blocks.KINDS``).
        others: (kind, passed, failed) of each candidate but the draft, recent evidence.
        row_cost: r, one verified position of one row relative to one target step.
        plan: this cycle's (proposal, draft length) per particle group (particle i runs
            ``plan[i % len(plan)]``); ``("target", 0)``: the target alone.
        kinds: each cycle's proposals.
    """

    block_size: int
    particles: int
    plain: bool
    cost: float
    passed: float = 0.0
    failed: float = 0.0
    prior_passed: float = 0.0
    prior_failed: float = 0.0
    lengths: tuple[int, ...] = ()
    candidates: tuple[str, ...] = ("draft",)
    others: tuple[tuple[str, float, float], ...] = ()
    row_cost: float = DEFAULT_ROW_POSITION_COST
    plan: tuple[tuple[str, int], ...] = ()
    kinds: tuple[tuple[str, ...], ...] = ()
    draft_off: bool = False

    @property
    def alone(self) -> bool:
        """The request decodes with the target alone this cycle (the draft did not pay)."""
        return bool(self.lengths) and self.lengths[-1] == 0

    @property
    def probing(self) -> bool:
        """The request has seen no cut yet, nor any record: it drafts half a block to learn."""
        return self.passed + self.failed == 0

    def planned_length(self) -> int:
        """The draft model's length the evidence so far calls for (0 once it stopped paying)."""
        if self.draft_off:  # no drafting, no new evidence: stay
            return 0
        if self.probing:
            # Probed even where no draft could pay (a CPU's r = 0.4): then a seed's first cycle,
            # and so its answer, does not hang on the machine's cost estimate (docs/algorithm.md).
            return max(1, self.block_size // 2)
        return self._best(self.passed / (self.passed + self.failed), self.cost)

    def _draft_pays(self) -> bool:
        """Whether the draft model may beat the target alone, now or later.

        Its evidence moves only while it drafts, so a draft that does not pay now never will.
        """
        if self.probing:
            return True
        length = self.planned_length()
        rate = self.passed / (self.passed + self.failed)
        return length > 0 and self._value(rate, length, self.cost) > self._value(0.0, 0, 0.0)

    def _could_pay(self, length: int, cost: float) -> bool:
        """Whether a proposal of this draft cost, every position passing, beats the target alone."""
        return self._value(1.0, length, cost) > self._value(0.0, 0, 0.0)

    def _rows(self, length: int, cost: float) -> int:
        """Rows a cycle runs: one for a plain request that runs no draft (c = 0), else N."""
        return 1 if self.plain and (length == 0 or cost == 0.0) else self.particles

    def _best(self, pass_rate: float, cost: float) -> int:
        """The best length for a proposal of this pass rate and draft cost."""
        return best_length(pass_rate, cost, self.block_size, self._rows(1, cost), self.row_cost)

    def _value(self, pass_rate: float, length: int, cost: float) -> float:
        """Expected tokens per unit of cost of one cycle."""
        rows = self._rows(length, cost)
        return expected_tokens(pass_rate, length) / cycle_cost(length, rows, cost, self.row_cost)

    def _options(self, retrievable: bool) -> tuple[list[str], list[tuple[float, str, int]]]:
        """Proposals to probe, and (expected tokens per cost, proposal, length) of the others."""
        probes, known = [], []
        draft_off = self.draft_off or self.planned_length() == 0
        for kind in self.candidates:
            if (USES_DRAFT[kind] and draft_off) or (kind != "draft" and not retrievable):
                continue
            if kind == "draft":
                length, rate, cost = self.planned_length(), None, self.cost
                if self.probing:
                    probes.append(kind)
                    continue
                rate = self.passed / (self.passed + self.failed)
            else:
                _, passed, failed = next(o for o in self.others if o[0] == kind)
                cost = self.cost if USES_DRAFT[kind] else 0.0
                if passed + failed < PROBE_BELOW:
                    if self._could_pay(self._probe_length(kind), cost):
                        probes.append(kind)
                    continue
                rate = passed / (passed + failed)
                length = self._best(rate, cost)
            known.append((self._value(rate, length, cost), kind, length))
        return probes, known

    def advanced(self, retrievable: bool = False) -> DraftSchedule:
        """The schedule with the next cycle's proposals and lengths decided.

        ``retrievable``: retrieval knows a continuation of some particle's context now.
        """
        probes, known = self._options(retrievable)
        if probes:  # the particles split among what is not known yet
            plan = tuple((k, self._probe_length(k)) for k in probes)
        else:
            alone = (self._value(0.0, 0, 0.0), "target", 0)
            best = max([alone, *known], key=lambda o: o[0])
            plan = (("target", 0),) if best[2] == 0 else ((best[1], best[2]),)
        off = self.draft_off or ("draft" in self.candidates and not self._draft_pays())
        return replace(
            self,
            lengths=(*self.lengths, max(n for _, n in plan)),
            plan=plan,
            kinds=(*self.kinds, tuple(k for k, _ in plan)),
            draft_off=off,
            others=tuple((k, RECENT * p, RECENT * f) for k, p, f in self.others),  # fading
        )

    def _probe_length(self, kind: str) -> int:
        """How far a probe of ``kind`` drafts: retrieval (no draft forward) a whole block, others half."""
        return self.block_size if kind == "retrieval" else max(1, self.block_size // 2)

    @property
    def length(self) -> int:
        """The current cycle's longest draft length."""
        return self.lengths[-1]

    def n_particles(self) -> int:
        """How many particles the current cycle runs (one: a plain request that runs no draft)."""
        no_draft = all(kind in ("target", "retrieval") for kind, _ in self.plan)
        return 1 if self.plain and no_draft and len(self.plan) == 1 else self.particles

    def observed(self, kept: Sequence[int], diverged: Sequence[bool]) -> DraftSchedule:
        """The schedule after one cycle's drafted blocks: tokens kept by the cut, and whether it fired."""
        return replace(self, passed=self.passed + sum(kept), failed=self.failed + sum(diverged))

    def observed_kind(self, kind: str, kept: Sequence[int], short: Sequence[bool]) -> DraftSchedule:
        """A retrieval or mixture cycle's evidence: tokens kept and blocks that ended short, per block."""
        if not kept:
            return self
        n = len(kept)
        others = tuple(
            (k, p + sum(kept) / n, f + sum(short) / n) if k == kind else (k, p, f) for k, p, f in self.others
        )
        return replace(self, others=others)

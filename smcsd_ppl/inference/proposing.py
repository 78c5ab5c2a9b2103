"""Which proposal draws each row's block: the kernel's side of ``proposals.blocks``.

A request's draft schedule plans, per cycle, a (proposal, draft length) for each group of
its particles; this module turns the plan into each row's length and ``RowProposal``, feeds
the request's retrieval index with what its particles wrote (between cycles only, so every
proposal depends on earlier cycles alone), and hands each proposal's evidence back to the
schedule.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import SMCConfig
from ..proposals.blocks import MIN_MATCH, NGRAM, PROBE_MATCH, USES_DRAFT, RequestIndex, RowProposal
from .blocks import ScoredBlock
from .program import SMCSDModel
from .state import Population

Plan = tuple[str, int]  # (proposal or "target", draft length)


def candidates(config: SMCConfig, feature_draft: bool) -> tuple[str, ...]:
    """The proposals a request of this run may use (``auto``: the draft and retrieval)."""
    if config.proposal != "auto" and config.proposal != "draft" and feature_draft:
        raise ValueError(
            f"proposal={config.proposal!r} needs a token draft: a feature draft reads the target's states "
            "at every position it drafts; use proposal='draft'"
        )
    if config.proposal == "auto":
        return ("draft",) if feature_draft or config.cut is None else ("draft", "retrieval")
    return (config.proposal,)


def uses_draft(kinds: tuple[str, ...]) -> bool:
    """Whether any of these proposals runs the draft model."""
    return any(USES_DRAFT[k] for k in kinds)


def new_index(program: SMCSDModel, kinds: tuple[str, ...]) -> RequestIndex | None:
    """A request's retrieval index over its prompt, when some proposal retrieves."""
    if kinds == ("draft",):
        return None
    return RequestIndex(program.main_context.prompt_ids)


def particle_plan(pop: Population, slot: int, config: SMCConfig) -> Plan:
    """What particle ``slot`` of a request draws its next block from, and how long."""
    if config.token_level:
        return ("target", 0)
    if pop.schedule is None:  # the paper's algorithm: fixed blocks from the chosen proposal
        return ("draft" if config.proposal == "auto" else config.proposal, config.block_size)
    plan = pop.schedule.plan
    return plan[slot % len(plan)]


def row_proposal(pop: Population, kind: str, ctx) -> RowProposal | None:
    """The ``RowProposal`` of one context's row (None: the draft or the target alone)."""
    if kind in ("draft", "target"):
        return None
    return RowProposal(kind, pop.retrieval, _tail(ctx.prompt_ids, ctx.generated))


def _tail(prompt, generated) -> tuple[int, ...]:
    """The last tokens of a context: all retrieval ever matches."""
    tail = list(generated[-NGRAM:])
    if len(tail) < NGRAM:
        tail = list(prompt[len(prompt) - (NGRAM - len(tail)) :]) + tail
    return tuple(tail)


def fed(pop: Population, before: Population) -> None:
    """Feed the request's index with what each particle wrote since ``before`` (same slots)."""
    if pop.retrieval is None:
        return
    for p, q in zip(pop.particles, before.particles):
        if p is q:
            continue
        old, new = q.token_ids, p.token_ids
        pop.retrieval.feed(_tail(p.main_context.prompt_ids, old), new[len(old) :])


def probe_match(plain: bool) -> int:
    """The suffix match that makes a request try retrieval (a plain one retrieves with one row)."""
    return MIN_MATCH if plain else PROBE_MATCH


def continues(index: RequestIndex | None, program: SMCSDModel, plain: bool) -> bool:
    """Whether retrieval knows a continuation of a request's prompt."""
    prompt = _tail(program.main_context.prompt_ids, ())
    return index is not None and index.continues(prompt, probe_match(plain))


def retrievable(pop: Population) -> bool:
    """Whether retrieval knows a continuation of a long suffix of some stepping particle's context.

    A free look at the index, and a prefix-only rule: whether the next cycle tries retrieval
    depends on what was written so far, never on the draws it will make.
    """
    if pop.retrieval is None:
        return False
    match = probe_match(pop.schedule is not None and pop.schedule.plain)
    return any(
        pop.retrieval.continues(_tail(p.main_context.prompt_ids, p.token_ids), match)
        for p in pop.particles
        if not p.done_stepping()
    )


def observed(pop: Population, blocks: list[tuple[Plan, ScoredBlock]]) -> Population:
    """The schedule after a cycle's blocks, each with the plan it was drafted under.

    The draft learns from its cuts (as before); retrieval and the mixture from the tokens
    kept and the blocks that ended short of their length with a bonus to draw (a cut, a
    stop for the target, nothing to retrieve): a rate that already holds the stops.
    """
    if pop.schedule is None:
        return pop
    schedule = pop.schedule
    drafts = [b for (kind, _), b in blocks if kind == "draft" and b.drafted]
    schedule = schedule.observed([b.kept for b in drafts], [b.diverged for b in drafts])
    for kind in ("retrieval", "mixture"):
        mine = [(n, b) for (k, n), b in blocks if k == kind and b.drafted]
        schedule = schedule.observed_kind(
            kind, [b.kept for _, b in mine], [b.bonus is not None and b.kept < n for n, b in mine]
        )
    return replace(pop, schedule=schedule)

"""One barrier flush, for every asking row at once: token-level steps, then blocks.

A block (``extend()``) is drafted, scored in one fused forward, verified and committed; the
verification itself is the pure ``verification.verify_blocks``; around it, the row store
runs the forwards and keeps the rows, and hard constraints supply their masks. A
token-level step (``next_token()``, ``mask_dist()``) asks for the target's next-token
distribution of its row: one target forward for every such row of the flush.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass, replace

import torch

from ..backends.base import to_device
from ..config import SMCConfig
from ..ends import row_ends
from ..proposals.blocks import RowProposal
from ..verification import BlockBatch, draw_restricted, verify_blocks
from ..verification.greedy import argmax_path, greedy_verdict
from ..verification.processing import RowSampling, processed
from ..verification.sampling import tempered_log_probs
from . import constrained, lookahead, structure
from .blocks import (
    BlockRequest,
    CycleAnswer,
    CycleRequest,
    DraftedBlock,
    ScoredBlock,
    TokenRequest,
    block_length,
    device_ending,
)
from .drafting import draft_blocks
from .flush import Flush
from .rows import RowStore
from .streams import RowStreams


def serve(
    store: RowStore,
    requests: Sequence[CycleRequest],
    *,
    config: SMCConfig,
    eos: Container[int],
    streams: RowStreams,
) -> list[CycleAnswer]:
    """Answer one flush's requests, in order.

    Each ``TokenRequest`` gets its row's next-token log-probabilities ``[V]`` (on the host),
    each ``BlockRequest`` its ``ScoredBlock``. ``streams`` holds each row's plan (its draft
    length, its proposal, its temperatures) and its random numbers.
    """
    out: list[CycleAnswer | None] = [None] * len(requests)
    tokens = [i for i, r in enumerate(requests) if isinstance(r, TokenRequest)]
    if tokens:
        for i, lp in zip(tokens, run_tokens(store, [requests[i] for i in tokens], streams)):
            out[i] = lp
    blocks = [i for i, r in enumerate(requests) if isinstance(r, BlockRequest)]
    if blocks:
        asked = [requests[i] for i in blocks]
        for i, b in zip(blocks, run_blocks(store, asked, config=config, eos=eos, streams=streams)):
            out[i] = b
    return out


@torch.inference_mode()
def run_tokens(store: RowStore, requests: Sequence[TokenRequest], streams: RowStreams) -> list[torch.Tensor]:
    """The next-token log-probabilities of each asking row at its temperature, on the host (one read)."""
    store.queue({r.row: r.unsent for r in requests})
    logits = store.next_logits([r.row for r in requests]).float()  # [n, V]
    plans = [streams.plans[r.row] for r in requests]
    temps = torch.tensor(
        [p.target_temperature if r.temperature is None else r.temperature for p, r in zip(plans, requests)],
        device=logits.device,
    )
    greedy = temps == 0
    settings = [p.sampling for p in plans]
    by_row = RowSampling.of(settings, logits.shape[-1], logits.device) if any(settings) else None
    logits = processed(logits, torch.where(greedy, 1.0, temps), torch.arange(len(plans)), by_row)
    lp = tempered_log_probs(logits, (~greedy).float()).cpu()  # tempered already; greedy: its point mass
    if bool(torch.isnan(lp).any()):  # on the host already: NaN logits are named here
        store.check_finite()
    return list(lp)


@torch.inference_mode()
def run_blocks(
    store: RowStore,
    requests: Sequence[BlockRequest],
    *,
    config: SMCConfig,
    eos: set[int],
    streams: RowStreams,
) -> list[ScoredBlock]:
    """SMC-SD blocks for ``requests`` (one per row), each drafting as far as its row's plan says.

    A row with nothing queued (a context's first block, or one right after a ``mask_dist``
    observation) first draws its lead token from the target, as a bonus is drawn. Returns each
    request's ``ScoredBlock``; its row then holds the kept tokens and awaits the bonus (or
    leaves at the next fork, if the context ended).
    """
    store.queue({r.row: r.unsent for r in requests})
    flush = Flush.of(store, requests, config.block_size, streams)
    leads = _leads(store, requests, config, eos, flush)
    out: dict[int, ScoredBlock] = {i: x.ended for i, x in leads.items() if x.ended is not None}
    go = [i for i in range(len(requests)) if i not in out]
    if go:
        store.queue({requests[i].row: [leads[i].token] for i in go if i in leads})
        # A row's retrieval reads what it sent and its lead too.
        asked = [
            replace(
                flush.request(i, _after_lead(requests[i], leads.get(i))),
                proposal=_then(flush.plans[i].proposal, requests[i].unsent, leads.get(i)),
            )
            for i in go
        ]
        lead_log_w = [leads[i].log_w if i in leads else 0.0 for i in go]
        for i, b in zip(go, _blocks(store, asked, lead_log_w, config, eos, flush)):
            out[i] = replace(b, lead=leads[i].token) if i in leads else b
    return [out[i] for i in range(len(requests))]


@dataclass(frozen=True)
class Lead:
    """A row's lead token, the log mass it was drawn from, and its block if the lead ends the row.

    ``tilts``: the structure read's tilts past the lead, for the tokens drafted after it.
    """

    token: int
    log_w: float
    ended: ScoredBlock | None
    tilts: structure.Tilts | None = None


def _leads(store, requests, c: SMCConfig, eos, flush: Flush) -> dict[int, Lead]:
    """Draw the lead token of every row with nothing queued, by request index.

    A lead comes from the target power within the context's mask and the block's constraint
    (in either mode, as a proposal is restricted), drawn as a bonus is; its weight is the mass
    drawn from, which the row's block weighs in.
    """
    todo = [i for i, r in enumerate(requests) if not store.target_pending[r.row]]
    if not todo:
        return {}
    rows = [requests[i].row for i in todo]
    read = lookahead.lead_tilts(store, rows, [requests[i].constraint for i in todo], flush.target_t, c.alpha)
    tilts = [t.get((), ()) for t in read]  # at the lead's own position
    logits = flush.temper(store.next_logits(rows).float(), rows)  # [m, V]
    masks = [requests[i].mask for i in todo]
    if any(m is not None for m in masks):  # a mask_dist observation: the target within it
        within = torch.stack(
            [torch.ones(logits.shape[-1], dtype=torch.bool) if m is None else m for m in masks]
        )
        logits = logits.masked_fill(~within.to(logits.device), -math.inf)
    factor = constrained.next_factors([requests[i].constraint for i in todo], logits.shape[-1], logits.device)
    drawn_from = factor
    if any(tilts):  # drawn from p Phi-hat(x t) / Phi-hat(x) over the structure read (inference.structure)
        tilted = torch.stack([constrained.tilt_vector(t, logits.shape[-1]) for t in tilts])
        drawn_from = factor + tilted.to(factor.device)
    lead, log_z = draw_restricted(logits, c.alpha, drawn_from, flush.uniforms[rows, 0])
    greedy = flush.greedy[rows].tolist()
    if any(greedy):  # the likeliest allowed token, of weight 1 (0 where none is allowed)
        best, allowed = argmax_path(logits, factor)
        on = to_device(torch.tensor(greedy), logits.device)
        lead = torch.where(on, best, lead)
        log_z = torch.where(on, torch.where(allowed, 0.0, -math.inf).to(log_z.dtype), log_z)
    tokens, log_z = lead.tolist(), log_z.tolist()  # one host read
    out = {}
    for j, i in enumerate(todo):
        # A tilted lead weighs p / q = Phi-hat(x) / Phi-hat(x t): the tilt is no part of the target.
        tilt = 0.0 if greedy[j] else dict(tilts[j]).get(tokens[j], 0.0)
        r, t, w = requests[i], tokens[j], log_z[j] - tilt
        stops = eos if flush.plans[i].stops_at_eos else ()
        if w == -math.inf and r.constraint is not None and not r.constraint.context:
            raise ValueError("the constraint allows no first token: no output can satisfy it")
        ended = None
        if row_ends(None if w == -math.inf else t, 1, r.budget, stops):
            ended = ScoredBlock(r.row, t, (), 0, None, w, True, dead=w == -math.inf)
        out[i] = Lead(t, w, ended, structure.past(read[j], t) if read[j] else None)
    return out


def _after_lead(request: BlockRequest, lead: Lead | None) -> BlockRequest:
    """The request as drafting sees it once its lead is queued (one token less of budget)."""
    if lead is None:
        return request
    c = request.constraint
    constraint = None if c is None else replace(c, context=(*c.context, lead.token), tilt=lead.tilts)
    return replace(request, budget=request.budget - 1, constraint=constraint, unsent=(), mask=None)


def _then(proposal: RowProposal | None, unsent: Sequence[int], lead: Lead | None) -> RowProposal | None:
    if proposal is None:
        return None
    return proposal.then([*unsent, *([] if lead is None else [lead.token])])


def _blocks(store, requests, lead_log_w, c: SMCConfig, eos, flush: Flush) -> list[ScoredBlock]:
    """Draft, score in one fused forward, verify and commit the blocks of rows with a token queued.

    The drafted tokens stay on the device until the verdict: one host read brings back both.
    """
    u = flush.uniforms.to(store.device)
    drafted = draft_blocks(
        store,
        requests,
        block_size=flush.k,
        temperature=flush.draft_t,
        eos=eos,
        draws=lambda j: u[:, 1 + j],
        keep_probs=c.cut is not None or flush.by_row is not None,  # a checked row's residual reads q
        sampling=flush.by_row,
    )
    k = block_length(drafted)  # one length for all: they are verified together
    flush.check(drafted, k)
    rows = [b.row for b in drafted]
    tokens = drafted[0].batch.tokens.index_select(0, to_device(torch.tensor(rows), store.device))  # [n, k]
    logits, hidden = store.score(rows, tokens, [b.feed for b in drafted])
    logits = flush.temper(logits, rows, in_place=True)  # [n, k+1, V]
    batch = block_batch(drafted, tokens, lead_log_w, logits.shape[-1], k > 0)
    verdict = verify_blocks(
        logits,
        batch,
        u[rows, -1],
        alpha=c.alpha,
        cut=c.cut if k else None,
        divergence=c.cut_divergence,
        padded=store.free_reads,
    )
    if flush.any_greedy:
        verdict = greedy_verdict(verdict, logits, batch, to_device(flush.greedy[rows], logits.device))
    read = _read_verdict(tokens, verdict)  # the cycle's one host read
    drafted[0].batch.known(rows, read.tokens)
    faulty = {i for i, w in enumerate(read.log_w) if math.isnan(w)}  # NaN logits show here, on the host
    fault = f"{store.nonfinite() or 'a model'} produced NaN logits on this request's rows" if faulty else ""
    out, nexts = [], []
    for i, b in enumerate(drafted):
        nxt = read.bonus[i] if read.has_bonus[i] else None
        ends = read.dead[i] or i in faulty or row_ends(nxt, read.kept[i] + 1, b.budget, b.eos)
        kept, w, dead = read.kept[i], read.log_w[i], read.dead[i]
        block = ScoredBlock(
            b.row,
            None,
            tuple(read.tokens[i]),
            kept,
            nxt,
            w,
            ends,
            dead,
            read.diverged[i],
            draft_forwards=b.forwards_until_end(read.tokens[i]),
        )
        out.append(replace(block, fault=fault) if i in faulty else block)
        nexts.append(None if ends else nxt)  # an ending row queues nothing and leaves
    store.commit(rows, read.tokens, read.kept, nexts, [b.fed for b in drafted], hidden)
    futures = lookahead.look_ahead(store, drafted, read.kept, nexts, flush.target_t, c.alpha)
    return [replace(b, log_future=f, tilt=tilt) for b, (f, tilt) in zip(out, futures)]


@dataclass(frozen=True)
class VerdictRead:
    """A verdict on the host: per row, its drafted tokens and every decision about them."""

    tokens: list[list[int]]
    kept: list[int]
    bonus: list[int]
    has_bonus: list[bool]
    dead: list[bool]
    diverged: list[bool]
    log_w: list[float]


def _read_verdict(tokens: torch.Tensor, verdict) -> VerdictRead:
    """The drafted tokens ``[n, k]`` and the verdict, in one host read (float64 holds every token id)."""
    k = tokens.shape[1]
    v = verdict
    decisions = torch.stack(
        [d.double() for d in (v.kept, v.bonus, v.has_bonus, v.dead, v.diverged, v.log_w)], 1
    )
    rows = torch.cat([tokens.double(), decisions], 1).tolist()
    kept, bonus, has_bonus, dead, diverged, log_w = zip(*(row[k:] for row in rows)) if rows else ([],) * 6
    return VerdictRead(
        [[int(t) for t in row[:k]] for row in rows],
        [int(x) for x in kept],
        [int(x) for x in bonus],
        [bool(x) for x in has_bonus],
        [bool(x) for x in dead],
        [bool(x) for x in diverged],
        list(log_w),
    )


def block_batch(
    drafted: Sequence[DraftedBlock],
    tokens: torch.Tensor,  # [n, k] the drafted blocks' tokens, on the device
    lead_log_w: Sequence[float],
    vocab: int,
    drawn: bool,
) -> BlockBatch:
    """The drafted blocks as verification reads them, on the tokens' device (``drawn``: k > 0).

    Where each block ends (an EOS, the budget) is found on the device: nothing is read.
    """
    device, batch = tokens.device, drafted[0].batch
    index = to_device(torch.tensor([b.row for b in drafted]), device)
    never = batch.k + 1  # the dead-end position of a block its constraint never ended
    rows = [[b.reach, b.budget, never if b.dead_at is None else b.dead_at, bool(b.eos)] for b in drafted]
    reach, budget, dead_at, stops_at = to_device(torch.tensor(rows).view(len(drafted), 4), device).unbind(1)
    eos = sorted({e for b in drafted for e in b.eos}) or [-1]  # an id no token has, where none is in force
    eos = to_device(torch.tensor(eos), device)
    limit, stops, dead = device_ending(tokens, reach, budget, dead_at, eos, stops_at.bool())
    probs = drawn and batch.probs is not None  # kept for the cut or a retrieval row
    return BlockBatch(
        tokens=tokens,
        draft_logq=batch.logq.index_select(0, index),
        limit=limit,
        stops=stops,
        dead=dead,
        lead_log_w=to_device(torch.tensor(lead_log_w, dtype=torch.float32), device),
        draft_probs=batch.probs.index_select(0, index) if probs else None,
        log_factor=constrained.proposal_factors(drafted, vocab, device),
        critic_allowed=constrained.critic_masks(drafted, vocab, device),
        log_tilt=constrained.proposal_tilts(drafted, vocab, device),
        **_retrieval_fields(drafted, device),
    )


def _retrieval_fields(drafted: Sequence[DraftedBlock], device: torch.device) -> dict:
    """``retrieved`` and ``checks`` of the batch, when a row was drawn by retrieval."""
    if all(b.checks is None for b in drafted):
        return {}
    k = drafted[0].batch.k
    checks = torch.tensor([b.checks or [0.0] * k for b in drafted], dtype=torch.float64).view(len(drafted), k)
    retrieved = torch.tensor([b.checks is not None for b in drafted])
    return dict(retrieved=to_device(retrieved, device), checks=to_device(checks, device))

"""One barrier flush, for every asking row at once: token-level steps, then blocks.

A block (``extend()``) is drafted, scored in one fused forward, verified and committed; the
verification itself is the pure ``verification.verify_blocks``; around it, the row store
runs the forwards and keeps the rows, and hard constraints supply their masks. A
token-level step (``next_token()``, ``mask_dist()``) asks for the target's next-token
distribution of its row: one target forward for every such row of the flush.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..backends.base import to_device
from ..config import SMCConfig
from ..verification import Verdict, power_log_normalizer, restrict_power, sample_tokens, verify_blocks
from . import constrained
from .blocks import BlockRequest, DraftedBlock, ScoredBlock, TokenRequest, block_length
from .drafting import draft_blocks
from .rows import RowStore


def serve(store: RowStore, requests: list, *, config: SMCConfig, eos: set[int], limits, g) -> list:
    """Answer one flush's requests, in order.

    Each ``TokenRequest`` gets its row's next-token log-probabilities ``[V]`` (on the host),
    each ``BlockRequest`` its ``ScoredBlock``; ``limits(row)`` is a row's draft length.
    """
    out: list = [None] * len(requests)
    tokens = [i for i, r in enumerate(requests) if isinstance(r, TokenRequest)]
    if tokens:
        for i, lp in zip(tokens, run_tokens(store, [requests[i] for i in tokens], config)):
            out[i] = lp
    blocks = [i for i, r in enumerate(requests) if isinstance(r, BlockRequest)]
    if blocks:
        asked = [requests[i] for i in blocks]
        lengths = [limits(r.row) for r in asked]
        for i, b in zip(blocks, run_blocks(store, asked, config=config, eos=eos, limits=lengths, g=g)):
            out[i] = b
    return out


@torch.inference_mode()
def run_tokens(store: RowStore, requests: Sequence[TokenRequest], config: SMCConfig) -> list[torch.Tensor]:
    """The next-token log-probabilities of each asking row at its temperature, on the host (one read)."""
    store.queue({r.row: r.unsent for r in requests})
    logits = store.next_logits([r.row for r in requests]).float()  # [n, V]
    temps = torch.tensor([r.temperature or config.target_temperature for r in requests], device=logits.device)
    lp = torch.log_softmax(logits / temps[:, None], -1).cpu()
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
    limits: Sequence[int],
    g: torch.Generator,
) -> list[ScoredBlock]:
    """SMC-SD blocks for ``requests`` (one per row), ``limits[i]`` drafted tokens at most each.

    A row with nothing queued (a context's first block, or one right after a ``mask_dist``
    observation) first draws its lead token from the target, as a bonus is drawn. Returns each
    request's ``ScoredBlock``; its row then holds the kept tokens and awaits the bonus (or
    leaves at the next fork, if the context ended).
    """
    store.queue({r.row: r.unsent for r in requests})
    leads = _leads(store, requests, config, eos, g)
    out: dict[int, ScoredBlock] = {i: b for i, (_, b) in leads.items() if b is not None}
    go = [i for i in range(len(requests)) if i not in out]
    if go:
        store.queue({requests[i].row: [leads[i][0][0]] for i in go if i in leads})
        asked = [_after_lead(requests[i], leads.get(i)) for i in go]
        blocks = _blocks(store, asked, [limits[i] for i in go], config, eos, g)
        for i, b in zip(go, blocks):
            lead, log_z = leads[i][0] if i in leads else (None, 0.0)
            out[i] = replace(b, lead=lead, log_weight=b.log_weight + log_z)
    return [out[i] for i in range(len(requests))]


def _leads(store, requests, c: SMCConfig, eos, g) -> dict[int, tuple[tuple[int, float], ScoredBlock | None]]:
    """Draw the lead token of every row with nothing queued.

    A lead comes from the target power within the context's mask and the block's constraint;
    its weight is the mass drawn from.

    Returns, by request index, ``(lead, log weight)`` and the finished block when the lead
    alone ends the context (an EOS, the budget, nothing allowed), else None.
    """
    todo = [i for i, r in enumerate(requests) if not store.target_pending[r.row]]
    if not todo:
        return {}
    logits = store.next_logits([requests[i].row for i in todo])  # [m, V], already known: no forward
    lp = torch.log_softmax(logits.float() / c.target_temperature, -1)
    masks = [requests[i].mask for i in todo]
    if any(m is not None for m in masks):
        within = torch.stack([torch.ones(lp.shape[-1], dtype=torch.bool) if m is None else m for m in masks])
        lp = lp.masked_fill(~within.to(lp.device), -math.inf)
        lp = lp - torch.logsumexp(lp, -1, keepdim=True)
    # A lead is restricted to what the constraint allows in either mode, as a proposal is.
    blocks = [
        FirstBlock(None if (x := requests[i].constraint) is None else replace(x, mode="proposal"))
        for i in todo
    ]
    factor = constrained.proposal_factors(blocks, lp.shape[-1], lp.device)
    power, log_z = restrict_power(
        c.alpha * lp, power_log_normalizer(lp, 1.0, c.alpha), None if factor is None else factor[:, 0]
    )
    lead = sample_tokens(power, 1.0, g)
    tokens, log_z = lead.tolist(), log_z.tolist()  # one host read
    out = {}
    for j, i in enumerate(todo):
        r, t, w = requests[i], tokens[j], log_z[j]
        if w == -math.inf and r.constraint is not None and not r.constraint.context:
            raise ValueError("the constraint allows no first token: no output can satisfy it")
        ends = w == -math.inf or t in eos or r.budget <= 1
        done = ScoredBlock(r.row, t, (), 0, None, w, True, dead=w == -math.inf) if ends else None
        out[i] = ((t, w), done)
    return out


def _after_lead(request: BlockRequest, lead) -> BlockRequest:
    """The request as drafting sees it once its lead is queued (one token less of budget)."""
    if lead is None:
        return request
    token = lead[0][0]
    c = request.constraint
    constraint = None if c is None else replace(c, context=(*c.context, token))
    return replace(request, budget=request.budget - 1, constraint=constraint, unsent=(), mask=None)


@dataclass
class FirstBlock:
    """The empty block before a lead token: its constraint's mask applies at position 0."""

    constraint: object
    stops: bool = False
    kept: int = 0
    tokens: tuple = ()
    kept_tokens: tuple = ()
    allowed: tuple = ()


def _blocks(store, requests, limits, c: SMCConfig, eos, g) -> list[ScoredBlock]:
    """Draft, score in one fused forward, verify and commit the blocks of rows with a token queued."""
    drafted = draft_blocks(
        store,
        requests,
        block_size=c.block_size,
        temperature=c.draft_temperature,
        eos=eos,
        g=g,
        limits=limits,
        keep_probs=c.cut is not None,
    )
    block_length(drafted)  # one length for all: they are verified together
    rows = [b.row for b in drafted]
    logits, hidden = store.score(rows, [b.tokens for b in drafted])
    logits = logits.div_(c.target_temperature)  # [n, k+1, V]
    verdict = _verify(drafted, logits, c, g)
    kept, bonus, has_bonus, dead, diverged = torch.stack(
        [verdict.kept, verdict.bonus, verdict.has_bonus, verdict.dead, verdict.diverged]
    ).tolist()  # one host read for every decision
    log_w = verdict.log_w.tolist()
    if any(math.isnan(w) for w in log_w):  # NaN logits show here, already on the host
        store.check_finite()
    _veto_critic_bonuses(drafted, kept, bonus, has_bonus, log_w)
    out, nexts = [], []
    for i, b in enumerate(drafted):
        nxt = bonus[i] if has_bonus[i] else None
        ends = nxt is None or nxt in eos or kept[i] + 1 >= b.budget or bool(dead[i])
        block = ScoredBlock(b.row, None, tuple(b.tokens), kept[i], nxt, log_w[i], ends, bool(dead[i]))
        out.append(replace(block, diverged=bool(diverged[i])))
        nexts.append(None if ends else nxt)  # an ending row queues nothing and leaves
    store.commit(rows, [b.tokens for b in drafted], kept, nexts, [b.fed for b in drafted], hidden)
    return out


def _verify(
    drafted: Sequence[DraftedBlock], logits: torch.Tensor, c: SMCConfig, g: torch.Generator
) -> Verdict:
    """The blocks as tensors on the logits' device, through ``verify_blocks``."""
    device, k = logits.device, logits.shape[1] - 1
    ends, stops, dead = torch.tensor([[b.kept, b.stops, b.dead] for b in drafted], dtype=torch.long).unbind(1)
    cutting = c.cut is not None and k > 0
    return verify_blocks(
        logits,
        to_device(torch.tensor([b.tokens for b in drafted], dtype=torch.long).view(len(drafted), k), device),
        to_device(torch.stack([b.draft_logq for b in drafted]).view(len(drafted), k), device),
        to_device(ends, device),
        to_device(stops.bool(), device),
        to_device(dead.bool(), device),
        g,
        alpha=c.alpha,
        cut=c.cut if cutting else None,
        divergence=c.cut_divergence,
        draft_probs=torch.stack([b.draft_probs for b in drafted]).to(device) if cutting else None,
        log_factor=constrained.proposal_factors(drafted, logits.shape[-1], device),
    )


def _veto_critic_bonuses(drafted, kept, bonus, has_bonus, log_w) -> None:
    """A critic's bonus drawn from the unrestricted target that breaks the constraint: zero weight."""
    critic = [
        i
        for i, b in enumerate(drafted)
        if has_bonus[i] and b.constraint is not None and b.constraint.mode == "critic"
    ]
    entries = [(drafted[i].constraint, drafted[i].tokens[: kept[i]], bonus[i]) for i in critic]
    for i, ok in zip(critic, constrained.check_bonus(entries)):
        if not ok:
            has_bonus[i], log_w[i] = False, -math.inf

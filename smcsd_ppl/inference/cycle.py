"""One cycle's blocks, for every asking row at once: draft, score in one fused forward, verify, commit.

This is what every ``extend()`` of a cycle waits for. The verification itself is the pure
``verification.verify_blocks``; around it, the row store runs the forwards and keeps the
rows, and hard constraints supply their masks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..backends.base import to_device
from ..config import SMCConfig
from ..verification import Verdict, verify_blocks
from . import constrained
from .blocks import BlockRequest, DraftedBlock, ScoredBlock, block_length
from .drafting import draft_blocks
from .rows import RowStore


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

    Returns each request's ``ScoredBlock``; its row then holds the kept tokens and awaits
    the bonus (or leaves at the next fork, if the particle ended).
    """
    c = config
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
        out.append(
            ScoredBlock(
                b.row, tuple(b.tokens), kept[i], nxt, log_w[i], ends, bool(dead[i]), bool(diverged[i])
            )
        )
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
        allowed=constrained.proposal_masks(drafted, logits.shape[-1], device),
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

"""The one-step lookahead: future validity estimated from the logits the verify already has.

Under ``SMCConfig.twist = "lookahead"`` (and ``"future-validity"`` where Phi cannot be
computed exactly) a constrained row's lead and bonus tokens, the target's own draws, look one
token ahead: each candidate t after a prefix x is judged by Phi-hat(x t), the target's mass
on what may follow x t. A forward on t would give the law after x t; the law t is drawn from,
p_T^alpha(. | x), stands in for it, so no forward is added. Where few tokens may follow x the
token is drawn from p_T^alpha(t | x) Phi-hat(x t) and weighs the mass it was drawn from over
Phi-hat(x t); each block's end then twists its particle by log Phi-hat (LLaMPPL's ``twist``,
divided out before the next step and at the end), so the weights stay proper for the
untwisted target. The exact twist is ``potentials.twist.FutureValidity``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..verification import draw_restricted
from .constrained import masks_for

LOOKAHEAD_BRANCHES = 32  # a token is drawn by lookahead where at most this many may come next


def one_step_phi(
    asks: Sequence[tuple[object, tuple[int, ...], int]],  # (constraint, prefix x, token t)
    power: torch.Tensor,  # [n, V] log p_T^alpha(. | x) of each ask
) -> list[float]:
    """The one-step estimate log Phi-hat(x t): the mass of p_T^alpha(. | x) on what may follow x t.

    A forward on t would give the law after x t itself; the law t was drawn from stands in for
    it, so the estimate needs no forward. 0 when t is an EOS (the output is complete).
    """
    out = [0.0] * len(asks)
    open_ = [n for n, (c, _, t) in enumerate(asks) if t not in c.eos_token_ids]
    if open_:
        masks = masks_for([(asks[n][0], (*asks[n][1], asks[n][2])) for n in open_])
        allowed = torch.stack(masks).to(power.device)
        rows = torch.tensor(open_, device=power.device)
        mass = torch.logsumexp(power[rows].masked_fill(~allowed, -math.inf), -1).tolist()
        for n, m in zip(open_, mass):
            out[n] = m
    return out


def lookahead_draws(
    asks: Sequence[tuple[object, tuple[int, ...]]],  # (a hard constraint, the prefix x)
    logits: torch.Tensor,  # [n, V] l / T_t after each x
    u: torch.Tensor,  # [n] a uniform per ask
    alpha: float,
) -> list[tuple[int, float, float] | None]:
    """Tokens drawn from p_T^alpha(t | x) Phi-hat(x t) where at most ``LOOKAHEAD_BRANCHES`` may follow x.

    Each drawn ask gets (t, log of the mass drawn from, log Phi-hat(x t)); its weight against the
    masked target is the mass over Phi-hat(x t). None where x allows one token or many (the
    caller keeps its own draw) or where every branch has Phi-hat = 0.
    """
    out: list[tuple[int, float, float] | None] = [None] * len(asks)
    allowed = masks_for(list(asks))
    few = [n for n, m in enumerate(allowed) if 1 < int(m.sum()) <= LOOKAHEAD_BRANCHES]
    if not few:
        return out
    branches = {n: allowed[n].nonzero().flatten().tolist() for n in few}
    flat = [(n, t) for n in few for t in branches[n]]
    power = alpha * torch.log_softmax(logits.float(), -1)  # [n, V]
    rows = torch.tensor([n for n, _ in flat], device=logits.device)
    phi = one_step_phi([(*asks[n], t) for n, t in flat], power[rows])
    factor = torch.full((len(few), logits.shape[-1]), -math.inf)
    at = {n: j for j, n in enumerate(few)}
    for (n, t), f in zip(flat, phi):
        factor[at[n], t] = f
    log_phi = dict(zip(flat, phi))
    sub = torch.tensor(few, device=logits.device)
    drawn, log_z = draw_restricted(logits[sub], alpha, factor.to(logits.device), u.to(logits.device)[sub])
    for n, t, z in zip(few, drawn.tolist(), log_z.tolist()):
        if math.isfinite(z) and math.isfinite(log_phi[n, t]):
            out[n] = (t, z, log_phi[n, t])
    return out


def look_ahead(
    blocks: Sequence,
    kept: list[int],
    bonus: list[int],
    has_bonus: list[bool],
    log_w: list[float],
    bonus_log_z: list[float],
    logits: torch.Tensor,  # [R, k+1, V] l / T_t at the drafted positions and after the last
    u: torch.Tensor,  # [R] the uniform each row's bonus was drawn with
    alpha: float,
) -> tuple[list[int], list[float], list[float | None]]:
    """The one-step lookahead at the end of each block that asks: (bonus, log-weight, log Phi-hat).

    Where few tokens may follow the kept prefix x, a proposal row's bonus is redrawn from
    p_T^alpha(b | x) Phi-hat(x b) (``lookahead_draws``, the same uniform) and weighs the mass it
    was drawn from over Phi-hat(x b). Every asking row's particle then twists by
    log Phi-hat(x b), which is divided out before its next step and at its end, so the weights
    stay proper for the untwisted target. Rows that do not ask keep their bonus and weight.
    """
    bonus, log_w, future = list(bonus), list(log_w), [None] * len(blocks)
    asking = [i for i, b in enumerate(blocks) if b.constraint and b.constraint.lookahead and has_bonus[i]]
    if not asking:
        return bonus, log_w, future
    prefix = {i: blocks[i].constraint.context + tuple(blocks[i].tokens[: kept[i]]) for i in asking}
    rows = torch.tensor(asking, device=logits.device)
    here = logits[rows, torch.tensor([kept[i] for i in asking], device=logits.device)]  # [n, V]
    # A row mixed with retrieval drew its bonus from the mixture: only rows the target drew are redrawn.
    redraw = [n for n, i in enumerate(asking) if blocks[i].constraint.mode == "proposal"]
    redraw = [n for n in redraw if not blocks[asking[n]].target_share]
    asks = [(blocks[asking[n]].constraint.constraint, prefix[asking[n]]) for n in redraw]
    drawn = lookahead_draws(asks, here[redraw], u[rows[redraw]], alpha) if redraw else []
    phi: dict[int, float] = {}
    for n, d in zip(redraw, drawn):
        if d is not None:
            i = asking[n]
            bonus[i], mass, phi[i] = d
            log_w[i] += mass - bonus_log_z[i] - phi[i]
    rest = [n for n, i in enumerate(asking) if i not in phi]
    if rest:
        power = alpha * torch.log_softmax(here[rest].float(), -1)
        asks = [(blocks[asking[n]].constraint.constraint, prefix[asking[n]], bonus[asking[n]]) for n in rest]
        phi |= {asking[n]: f for n, f in zip(rest, one_step_phi(asks, power))}
    for i in asking:
        complete = bonus[i] in blocks[i].constraint.constraint.eos_token_ids
        future[i] = phi[i] if math.isfinite(phi[i]) and not complete else None
    return bonus, log_w, future

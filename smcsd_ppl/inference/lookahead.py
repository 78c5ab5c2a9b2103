"""The one-step lookahead: each block's end twisted by the target's valid mass one token on.

Under ``SMCConfig.twist = "lookahead"`` (and ``"future-validity"`` where Phi cannot be
computed exactly), once a constrained row's block has committed its bonus b, the row reads b
at once: one target forward of one position, which gives the law after the new prefix x b.
Its mass on what the constraint allows next,

    Phi-hat(x b) = sum over t allowed after x b of p_T^alpha(t | x b) / Z,

is the chance that the next token keeps x b valid: the one-step estimate of the future
validity. The particle twists by log Phi-hat (LLaMPPL's ``twist``: divided out before its next
step and at its end), so the weights stay proper for the untwisted target, and resampling sees
which prefixes the target can go on from. The forward is not spent twice: the row's next block
draws its lead from the law read here (``cycle._leads``), and that lead weighs exactly Phi-hat.

The law the bonus was drawn from cannot stand in for the law after it: at a string's closing
quote that law is the string's, and it would score the structure the grammar asks for next
(``,``, ``}``) as nearly impossible, which steers particles away from closing anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..verification.sampling import power_log_normalizer, restrict_power
from . import constrained


def look_ahead(
    store,
    blocks: Sequence,
    kept: Sequence[int],
    nexts: Sequence[int | None],
    target_t: torch.Tensor,  # [R] each backend row's T_t
    alpha: float,
) -> list[float | None]:
    """The log Phi-hat(x b) of each asking block that goes on (None elsewhere), once the rows are committed.

    A block asks when its constraint looks ahead and it queued a bonus b (``nexts``). A feature
    draft's rows cannot be read ahead of the draft, so they are not twisted.
    """
    out: list[float | None] = [None] * len(blocks)
    asking = [
        i
        for i, b in enumerate(blocks)
        if nexts[i] is not None and b.constraint is not None and b.constraint.lookahead
    ]
    if not asking or store.reads_hidden:
        return out
    rows = [blocks[i].row for i in asking]
    logits = store.next_logits(rows).float() / target_t[rows, None].to(store.device)  # [n, V]
    after = [_after(blocks[i].constraint, blocks[i].tokens[: kept[i]], nexts[i]) for i in asking]
    factor = constrained.next_factors(after, logits.shape[-1], logits.device)
    _, log_phi = restrict_power(alpha * logits, power_log_normalizer(logits, 1.0, alpha), factor)
    for i, f in zip(asking, log_phi.tolist()):
        out[i] = f if math.isfinite(f) else None  # nothing may follow: the next lead's weight says so
    return out


def _after(constraint, kept: Sequence[int], bonus: int):
    """The row's constraint as it stands after the block: its context extended by the kept tokens and b."""
    return replace(constraint, context=(*constraint.context, *kept, bonus))

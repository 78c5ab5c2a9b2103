"""The one-step lookahead: each block's end twisted by the target's valid mass one token on.

Under ``SMCConfig.twist = "lookahead"`` (and ``"structure"``, which reads on from here:
``inference.structure``), once a constrained row's block has committed its bonus b, the row reads b
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
from . import constrained, structure


def look_ahead(
    store,
    blocks: Sequence,
    kept: Sequence[int],
    nexts: Sequence[int | None],
    target_t: torch.Tensor,  # [R] each backend row's T_t
    alpha: float,
) -> list[tuple[float | None, tuple | None]]:
    """Each block's (log Phi-hat(x b), the next lead's tilt), once the rows are committed.

    The estimate is None for a block that does not ask or ends; the tilt, (token, log Phi-hat(x b
    token)) for each token followed from x b, is None but where the structure was read.

    A block asks when its constraint looks ahead and it queued a bonus b (``nexts``). A feature
    draft's rows cannot be read ahead of the draft, so they are not twisted.
    """
    out: list[tuple[float | None, tuple | None]] = [(None, None)] * len(blocks)
    asking = [
        i
        for i, b in enumerate(blocks)
        if nexts[i] is not None and b.constraint is not None and b.constraint.lookahead
    ]
    if not asking or store.reads_hidden:
        return out
    after = [_after(blocks[i].constraint, blocks[i].tokens[: kept[i]], nexts[i]) for i in asking]
    trees = grow_trees(store, after)
    # The ends left out are not twisted: their bonus waits for the next verify.
    reading = _finite(store, after, trees)
    asking, after, trees = ([x[n] for n in reading] for x in (asking, after, trees))
    if not asking:
        return out
    rows = [blocks[i].row for i in asking]
    logits, read = read_structure(store, rows, after, target_t, alpha, trees=trees)  # the bonus too
    factor = constrained.next_factors(after, logits.shape[-1], logits.device)
    _, log_phi = restrict_power(alpha * logits, power_log_normalizer(logits, 1.0, alpha), factor)
    for i, f, end, structured in zip(asking, log_phi.tolist(), after, read):
        # read with nothing to follow (a wide mask, no room): no tilt, and no second read at the lead
        f, tilt = structured or (f, {} if end.structure else None)
        # -inf: nothing may follow, which the next lead's weight says
        out[i] = (f, tilt) if math.isfinite(f) else (None, None)
    return out


def lead_tilts(
    store, rows: Sequence[int], ends: Sequence, target_t: torch.Tensor, alpha: float
) -> list[structure.Tilts]:
    """Each lead's tilts (``structure.Tilts``): its last block's, or read now (a context's first).

    ``ends``: the rows' ``RowConstraint`` (None: unconstrained, no tilt).
    """
    tilts = [(e.tilt or {}) if e is not None else {} for e in ends]
    reading = [n for n, e in enumerate(ends) if e is not None and e.structure and e.tilt is None]
    if reading and not store.reads_hidden:  # a feature draft's rows are not read ahead
        for n in reading:
            tilts[n] = {}
        first = [ends[n] for n in reading]
        trees = grow_trees(store, first, structure.FIRST_NODES)
        keep = _finite(store, first, trees)
        reading, trees = [reading[n] for n in keep], [trees[n] for n in keep]
        if reading:
            at, first = [rows[n] for n in reading], [ends[n] for n in reading]
            _, read = read_structure(store, at, first, target_t, alpha, trees=trees)
            for n, structured in zip(reading, read):
                tilts[n] = structured[1] if structured else {}
    return tilts


def _finite(store, ends: Sequence, trees: Sequence[structure.Tree]) -> list[int]:
    """The ends to read: all but those of a ``finite`` twist whose structure opens into free text.

    There ``finite`` twists by nothing (Phi-hat 1, a value of the prefix alone, so the weights
    stay proper), and no forward is spent on them. On a backend without token trees (vLLM) it
    reads no end: what lies ahead is not known to be finite.
    """
    unknown = not _reads_trees(store)
    return [n for n, (e, t) in enumerate(zip(ends, trees)) if not (e.finite and (t.opens or unknown))]


def read_structure(
    store,
    rows: Sequence[int],
    ends: Sequence,
    target_t: torch.Tensor,
    alpha: float,
    nodes: int = structure.NODES,
    trees: Sequence[structure.Tree] | None = None,
):
    """Each row's tempered next-token logits ``[n, V]``, and through the structure after it (or None).

    The rows' queued tokens and the trees grown from ``ends`` (``RowConstraint``; those that ask
    for ``structure``; up to ``nodes`` tokens each) are read in one target forward; where no
    tree grows (or the backend has none) this is ``next_logits``. The second list holds
    ``structure.log_phi``'s (log Phi-hat, tilt) for each row read on, None for the others.
    """
    trees = grow_trees(store, ends, nodes) if trees is None else trees
    grown = [n for n, t in enumerate(trees) if len(t.tokens) > 1]
    one_step = [None] * len(rows)
    if not grown:
        return _tempered(store.next_logits(rows), rows, target_t), one_step
    branches = [(t.tokens[1:], [p - 1 for p in t.parents[1:]]) for t in trees]
    try:
        raw, nodes = store.next_logits_and_trees(rows, branches)
    except ValueError:  # past the context or the KV budget, refused before any row moved
        return _tempered(store.next_logits(rows), rows, target_t), one_step
    logits = _tempered(raw, rows, target_t)
    out: list = [None] * len(rows)
    for n in grown:
        laws = torch.cat([logits[n : n + 1], nodes[n].float() / target_t[rows[n]].to(raw.device)])
        law = alpha * torch.log_softmax(laws, -1).cpu()
        out[n] = structure.log_phi(trees[n], law, ends[n].constraint.eos_token_ids)
    return logits, out


def grow_trees(store, ends: Sequence, nodes: int = structure.NODES) -> list[structure.Tree]:
    """``structure.grow``'s tree for each end that asks for ``structure`` (a bare root for the others)."""
    trees = [structure.Tree() for _ in ends]
    reading_on = [n for n, e in enumerate(ends) if e.structure and _reads_trees(store)]
    for n, tree in zip(reading_on, structure.grow([ends[n] for n in reading_on], nodes=nodes)):
        trees[n] = tree
    return trees


def _reads_trees(store) -> bool:
    """Whether the target reads token trees (else nothing is grown: it could not be read)."""
    return hasattr(store.target, "extend_tree")


def _tempered(raw: torch.Tensor, rows: Sequence[int], target_t: torch.Tensor) -> torch.Tensor:
    """Untempered next-token logits ``[n, V]`` of ``rows``, divided by each row's T_t."""
    return raw.float() / target_t[rows, None].to(raw.device)


def _after(constraint, kept: Sequence[int], bonus: int):
    """The row's constraint as it stands after the block: its context extended by the kept tokens and b."""
    return replace(constraint, context=(*constraint.context, *kept, bonus))

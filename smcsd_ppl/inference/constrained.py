"""How hard constraints enter a cycle: masked proposals, critic cuts, masked bonus draws.

Both roles keep SMC-SD properly weighted for the target p^alpha x constraint:

* proposal: q is restricted to allowed tokens and renormalized, so the drafted
  tokens' log q already is the proposal's density (the weight p/q_masked carries
  the allowed mass of q). A weighted constraint tilts q by its factors as well (q times
  the factor, renormalized): the draft proposes what the tilted target favours, and
  the weight still reads the density it drew from. So does the structure read's tilt
  (``inference.structure``), which tilts q by Phi-hat where the drafted tokens follow its
  tree and never enters the target;
* critic: the draft samples freely and the constraint weighs the block: a block
  with an impossible token has weight zero. The row keeps only the valid prefix
  (nothing invalid is fed to later forwards) and the particle is resampled away.
  It does not continue from the cut: a particle that could resume after a cut of
  variable length would reach the same output through several block
  segmentations, and its weights would then overcount outputs (the tests show this
  bias). Use ``proposal`` mode for particles that always stay alive.

In proposal mode the bonus token is drawn from the target restricted to allowed
tokens, and its weight is the allowed mass of p^alpha instead of the full
normalizer; in critic mode it is drawn from the unrestricted target, and one outside what
the constraint allows vetoes the block.
Where the draft gives every allowed token zero mass (it underflows), the block ends
there and the target draws that token: the decision reads the prefix only, so the
weights stay proper and no particle dies where the target still has mass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..backends.base import to_device


def masks_for(pairs: Sequence[tuple[object, tuple[int, ...]]]) -> list[torch.Tensor]:
    """``next_mask`` for (constraint, context) pairs, one batched call per constraint."""
    return _per_constraint(pairs, lambda c, contexts: c.next_mask(contexts))


def factors_for(pairs: Sequence[tuple[object, tuple[int, ...]]]) -> list[torch.Tensor]:
    """``next_log_weights`` for (constraint, context) pairs, one batched call per constraint."""
    return _per_constraint(pairs, lambda c, contexts: c.next_log_weights(contexts))


def masks_and_factors(
    pairs: Sequence[tuple[object, tuple[int, ...]]],
) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """Every pair's mask, and the factors of the weighted constraints' pairs (by pair index).

    A weighted constraint's mask is where its factors are finite: one call gives both.
    """
    weighted = [n for n, (c, _) in enumerate(pairs) if c.weighted]
    factors = dict(zip(weighted, factors_for([pairs[n] for n in weighted])))
    hard = iter(masks_for([p for n, p in enumerate(pairs) if n not in factors]))
    return [torch.isfinite(factors[n]) if n in factors else next(hard) for n in range(len(pairs))], factors


def _per_constraint(pairs, ask) -> list[torch.Tensor]:
    """``ask(constraint, contexts)`` once per distinct constraint, its rows put back in order."""
    out: list[torch.Tensor | None] = [None] * len(pairs)
    groups: dict[int, list[int]] = {}
    for i, (c, _) in enumerate(pairs):
        groups.setdefault(id(c), []).append(i)
    for idx in groups.values():
        for i, row in zip(idx, ask(pairs[idx[0]][0], [pairs[i][1] for i in idx])):
            out[i] = row
    return out


def tilt_vector(tilt: Sequence[tuple[int, float]], vocab: int) -> torch.Tensor:
    """``[V]`` log-tilt: log Phi-hat for each token of ``tilt``, 0 (no tilt) elsewhere."""
    out = torch.zeros(vocab)
    if tilt:
        out[[t for t, _ in tilt]] = torch.tensor([v for _, v in tilt], dtype=out.dtype)
    return out


def _nonempty(masks: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each mask allows some token: one reduction for all (bool any() is slow on CPU)."""
    return torch.stack(list(masks)).view(torch.uint8).amax(1).bool().tolist() if masks else []


class Masking:
    """The constrained rows of one drafting round that use ``mode``.

    Args:
        rows: backend row of each request.
        constraints: ``RowConstraint`` or None per request.
        mode: ``"proposal"`` or ``"critic"``.
    """

    def __init__(self, rows: Sequence[int], constraints: Sequence, mode: str) -> None:
        self.items = [
            (i, r, c) for i, (r, c) in enumerate(zip(rows, constraints)) if c is not None and c.mode == mode
        ]
        self.dead_at: dict[int, int] = {}  # request index -> position where nothing was allowed
        # request index -> position where the draft gave the allowed tokens no mass (underflow),
        # or where a row drafting forced tokens only meets a choice: the block ends there and
        # the bonus is drawn from the target (a prefix-only cut).
        self.cut_at: dict[int, int] = {}
        self.history: dict[int, list[torch.Tensor]] = {}  # request index -> its mask at each position
        self.tilts: dict[int, torch.Tensor] = {}  # request index -> its log-tilt of q [V] (latest)
        self.position = 0  # of the token the latest masks are for
        self.host_drafted: list[list[int]] = []  # drafted tokens per step, read once each

    def ended_at(self) -> dict[int, int]:
        """Requests whose block a constraint has ended, and where (dead ends and underflows)."""
        return self.dead_at | self.cut_at

    def next_masks(self, drafted: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Allowed tokens ``[V]`` (bool) at the next position of each live row, by request.

        A row whose constraint allows nothing there dies at this position.
        """
        self.position = len(drafted)
        live = [(i, r, c) for i, r, c in self.items if i not in self.dead_at and i not in self.cut_at]
        if not live:
            return {}
        for d in drafted[len(self.host_drafted) :]:  # one host read per step, not per element
            self.host_drafted.append(d.tolist())
        steps = self.host_drafted[: len(drafted)]
        contexts = [(c.constraint, c.context + tuple(d[r] for d in steps)) for _, r, c in live]
        masks, factors = masks_and_factors(contexts)
        self.tilts = {live[n][0]: f for n, f in factors.items()}
        for n, (i, r, c) in enumerate(live):  # on the structure read's tree: q tilted by its Phi-hat
            tilt = c.tilt.get(tuple(d[r] for d in steps)) if c.tilt else None
            if tilt:
                self.tilts[i] = self.tilts.get(i, 0.0) + tilt_vector(tilt, masks[n].shape[-1])
        out = {}
        for (i, _, _), mask, some in zip(live, masks, _nonempty(masks)):
            self.history.setdefault(i, []).append(mask)
            if some:
                out[i] = mask
            else:
                self.dead_at[i] = self.position
        return out

    def restrict(self, q: torch.Tensor, allowed: dict[int, torch.Tensor]) -> None:
        """Zero disallowed tokens of q ``[R, V]`` in place, tilt by weighted factors, renormalize, per row."""
        items = [(i, r) for i, r, _ in self.items if i in allowed]
        if not items:
            return
        rows = [r for _, r in items]
        every = rows == list(range(len(q)))  # usually: then no copies in and out
        index = torch.tensor(rows, device=q.device)
        kept = q if every else q.index_select(0, index)
        kept.mul_(torch.stack([allowed[i] for i, _ in items]).to(q.device))  # one op for all rows
        tilted = [(j, self.tilts[i]) for j, (i, _) in enumerate(items) if i in self.tilts]
        if tilted:  # factors shifted by their largest: exp never overflows, the ratio is the same
            at = torch.tensor([j for j, _ in tilted], device=q.device)
            f = torch.stack([f for _, f in tilted]).to(q.device, q.dtype)
            f = f - f.amax(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).min)
            kept.index_copy_(0, at, kept.index_select(0, at) * f.exp())
        total = kept.sum(-1, keepdim=True)
        kept.div_(total.clamp_min(torch.finfo(q.dtype).tiny))
        for j, ((i, _), ok) in enumerate(zip(items, (total[:, 0] > 0).tolist())):
            if not ok:  # the draft gives the allowed tokens no mass: the block ends here
                self.cut_at[i] = self.position
                kept[j] = 1.0 / kept.shape[1]  # any distribution will do: the token is dropped
        if not every:
            q.index_copy_(0, index, kept)

    def first_impossible(self, tokens: torch.Tensor) -> dict[int, int]:
        """Critic rows: position of the first drafted token the constraint forbids.

        ``tokens [R, K]`` are the drafted tokens; the constraint checks every
        prefix of every block in one batched ``allows`` call per constraint.
        """
        if not self.items:
            return {}
        k = tokens.shape[1]
        out = {}
        groups: dict[int, list] = {}
        for i, r, c in self.items:
            groups.setdefault(id(c.constraint), []).append((i, r, c))
        for items in groups.values():
            seqs = [c.context + tuple(tokens[r, : j + 1].tolist()) for _, r, c in items for j in range(k)]
            ok = items[0][2].constraint.allows(seqs)
            for n, (i, _, _) in enumerate(items):
                bad = [j for j in range(k) if not ok[n * k + j]]
                if bad:
                    out[i] = bad[0]
        return out


def live_masks(
    allowed: dict[int, torch.Tensor], rows: Sequence[int], ended: torch.Tensor
) -> dict[int, torch.Tensor] | None:
    """Allowed tokens of every row still drafting, by row; None if one of them is unconstrained.

    ``allowed`` maps a request to its allowed tokens (``Masking.next_masks``), ``rows`` a
    request to its row, ``ended [R]`` marks rows whose later tokens do not count.
    """
    if not allowed:
        return None
    by_row = {rows[i]: mask for i, mask in allowed.items()}
    live = [r for r, done in enumerate(ended.tolist()) if not done]
    if any(r not in by_row for r in live):
        return None
    return {r: by_row[r] for r in live}


def forced_tokens(masks: dict[int, torch.Tensor], n_rows: int) -> torch.Tensor | None:
    """The one allowed token of each row ``[R]`` (0 for rows not drafting); None if any has a choice."""
    if any(int(m.sum()) != 1 for m in masks.values()):
        return None
    out = torch.zeros(n_rows, dtype=torch.long)
    for r, m in masks.items():
        out[r] = int(m.nonzero()[0, 0])
    return out


def shared_vocab(masks: dict[int, torch.Tensor], vocab_size: int) -> torch.Tensor | None:
    """The tokens any drafting row may take, when they are few enough to compute logits for only them."""
    if not masks:
        return None
    union = torch.stack(list(masks.values())).amax(0)  # amax: bool any() is slower on CPU
    return torch.nonzero(union)[:, 0] if int(torch.count_nonzero(union)) <= vocab_size // 4 else None


def critic_masks(blocks: Sequence, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """What each critic row's hard constraint allows at each position of its block and after it.

    Returns ``[R, k+1, V]`` bool (True everywhere for other rows and past a row's limit),
    None when no row has a critic's hard constraint: a bonus drawn outside vetoes the block.
    """
    rows = [
        i
        for i, b in enumerate(blocks)
        if b.constraint is not None and b.constraint.mode == "critic" and not b.constraint.constraint.weighted
    ]
    if not rows:
        return None
    k = blocks[0].batch.k
    at = [(i, j) for i in rows if not blocks[i].stops for j in range(min(k, blocks[i].limit) + 1)]
    pairs = [
        (blocks[i].constraint.constraint, blocks[i].constraint.context + tuple(blocks[i].tokens[:j]))
        for i, j in at
    ]
    out = torch.ones(len(blocks), k + 1, vocab_size, dtype=torch.bool)
    for (i, j), mask in zip(at, masks_for(pairs)):
        out[i, j] = mask
    return to_device(out, device)


def next_factors(constraints: Sequence, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """Each row's constraint's log-weights for its next token, in either mode (``[R, V]``).

    -inf where a hard constraint forbids, its own log-weights for a weighted one, 0 for rows
    without one; None when no row has one. A lead token is drawn within them.
    """
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return None
    out = torch.zeros(len(constraints), vocab_size)
    hard = [i for i in rows if not constraints[i].constraint.weighted]
    soft = [i for i in rows if constraints[i].constraint.weighted]
    for i, mask in zip(hard, masks_for([(constraints[i].constraint, constraints[i].context) for i in hard])):
        out[i] = torch.where(mask, 0.0, -math.inf)
    for i, w in zip(soft, factors_for([(constraints[i].constraint, constraints[i].context) for i in soft])):
        out[i] = w
    return to_device(out, device)


def proposal_factors(blocks: Sequence, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """What each row's constraint weighs, at each drafted position and after them.

    Returns ``[R, k+1, V]`` float log-weights: -inf where not allowed, 0 where allowed (and for
    unconstrained rows and past a row's end), a weighted constraint's own log-weights where it
    has them; None when no row needs them. Proposal-mode rows and rows of a weighted constraint
    in either mode count (a critic's hard constraint weighs through its ``allows`` instead). A
    hard constraint's masks come from drafting, the one at the block's end (where the bonus may
    be drawn) is computed here; a weighted one is asked for its weights up to the end, in one call.
    """
    rows = [
        i
        for i, b in enumerate(blocks)
        if b.constraint is not None and (b.constraint.mode == "proposal" or b.constraint.constraint.weighted)
    ]
    if not rows:
        return None
    k = blocks[0].batch.k
    out = torch.zeros(len(blocks), k + 1, vocab_size)
    hard = [i for i in rows if not blocks[i].constraint.constraint.weighted]
    for i, masks in zip(hard, _hard_masks(blocks, hard)):
        if masks:
            out[i, : min(k + 1, len(masks))] = torch.where(torch.stack(masks[: k + 1]), 0.0, -math.inf)
    soft = [
        (i, j)
        for i in rows
        if blocks[i].constraint.constraint.weighted
        for j in range(min(k, blocks[i].limit) + 1)
    ]
    pairs = [
        (blocks[i].constraint.constraint, blocks[i].constraint.context + tuple(blocks[i].tokens[:j]))
        for i, j in soft
    ]
    for (i, j), w in zip(soft, factors_for(pairs)):
        out[i, j] = w
    return to_device(out, device)


def proposal_tilts(blocks: Sequence, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """``[R, k+1, V]`` the structure read's log-tilt at each drafted position and after them.

    Where a proposal-mode row's tokens follow the tree its last block read (``RowConstraint.tilt``),
    q was drawn tilted by it (``Masking``) and the bonus will be; 0 elsewhere, and for rows drawn
    by retrieval, which the target checks token by token. None when no row has one.
    """
    rows = [
        i
        for i, b in enumerate(blocks)
        if b.constraint is not None and b.constraint.tilt and b.constraint.mode == "proposal"
        if b.checks is None
    ]
    if not rows:
        return None
    k = blocks[0].batch.k
    out = torch.zeros(len(blocks), k + 1, vocab_size)
    for i in rows:
        tilts, tokens = blocks[i].constraint.tilt, blocks[i].tokens
        for j in range(min(k, blocks[i].limit) + 1):
            tilt = tilts.get(tuple(tokens[:j]))
            if tilt:
                out[i, j] = tilt_vector(tilt, vocab_size)
    return to_device(out, device)


def _hard_masks(blocks, rows) -> list[list[torch.Tensor]]:
    """Each row's masks from drafting, with the one at the block's end added where it is missing."""
    masks = {i: list(blocks[i].allowed) for i in rows}
    need = [i for i in rows if len(masks[i]) <= blocks[i].limit and not blocks[i].stops]
    pairs = [
        (blocks[i].constraint.constraint, blocks[i].constraint.context + tuple(blocks[i].countable))
        for i in need
    ]
    for i, mask in zip(need, masks_for(pairs)):
        masks[i] = masks[i][: blocks[i].limit] + [mask]
    return [masks[i] for i in rows]

"""How hard constraints enter a cycle: masked proposals, critic cuts, masked bonus draws.

Both roles keep SMC-SD properly weighted for the target p^alpha x constraint:

* proposal: q is restricted to allowed tokens and renormalized, so the drafted
  tokens' log q already is the proposal's density (the weight p/q_masked carries
  the allowed mass of q);
* critic: the draft samples freely and the constraint weighs the block: a block
  with an impossible token has weight zero. The row keeps only the valid prefix
  (nothing invalid is fed to later forwards) and the particle is resampled away.
  It does not continue from the cut: a particle that could resume after a cut of
  variable length would reach the same output through several block
  segmentations, and its weights would then overcount outputs (the tests show this
  bias). Use ``proposal`` mode for particles that always stay alive.

In proposal mode the bonus token is drawn from the target restricted to allowed
tokens, and its weight is the allowed mass of p^alpha instead of the full
normalizer; in critic mode it is drawn from the unrestricted target and checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..potentials.constraints import allows


def _masks(pairs: Sequence[tuple[object, tuple[int, ...]]]) -> list[torch.Tensor]:
    """``next_mask`` for (constraint, context) pairs, one batched call per constraint."""
    out: list[torch.Tensor | None] = [None] * len(pairs)
    groups: dict[int, list[int]] = {}
    for i, (c, _) in enumerate(pairs):
        groups.setdefault(id(c), []).append(i)
    for idx in groups.values():
        masks = pairs[idx[0]][0].next_mask([pairs[i][1] for i in idx])
        for i, m in zip(idx, masks):
            out[i] = m
    return out


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
        self.position = 0  # of the token the latest masks are for

    def next_masks(self, drafted: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Allowed tokens ``[V]`` (bool) at the next position of each live row, by request.

        A row whose constraint allows nothing there dies at this position.
        """
        self.position = len(drafted)
        live = [(i, r, c) for i, r, c in self.items if i not in self.dead_at]
        if not live:
            return {}
        contexts = [(c.constraint, c.context + tuple(int(d[r]) for d in drafted)) for _, r, c in live]
        out = {}
        for (i, _, _), mask in zip(live, _masks(contexts)):
            if mask.any():
                out[i] = mask
            else:
                self.dead_at[i] = self.position
        return out

    def restrict(self, q: torch.Tensor, allowed: dict[int, torch.Tensor]) -> None:
        """Zero disallowed tokens of q ``[R, V]`` in place and renormalize, per row."""
        for i, r, _ in self.items:
            if i not in allowed:
                continue
            row = q[r] * allowed[i].to(q.device)
            total = row.sum()
            if total > 0:
                q[r] = row / total
            else:  # the draft gives the allowed tokens no mass: the particle dies here
                self.dead_at[i] = self.position

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
            ok = allows(items[0][2].constraint, seqs)
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
    union = torch.stack(list(masks.values())).any(0)
    return torch.nonzero(union)[:, 0] if int(union.sum()) <= vocab_size // 4 else None


def check_bonus(blocks: Sequence, bonus: Sequence[int]) -> list[bool]:
    """Critic rows: whether the bonus token drawn from the unrestricted target is allowed."""
    ok = [True] * len(blocks)
    rows = [i for i, b in enumerate(blocks) if b.constraint is not None and b.constraint.mode == "critic"]
    groups: dict[int, list[int]] = {}  # one batched call per constraint
    for i in rows:
        groups.setdefault(id(blocks[i].constraint.constraint), []).append(i)
    for idx in groups.values():
        c = blocks[idx[0]].constraint.constraint
        seqs = [blocks[i].constraint.context + tuple(blocks[i].kept_tokens) + (int(bonus[i]),) for i in idx]
        for i, good in zip(idx, allows(c, seqs)):
            ok[i] = good
    return ok


def restrict_bonus(power_logits: torch.Tensor, log_z: torch.Tensor, blocks: Sequence) -> torch.Tensor:
    """Mask the bonus distribution of constrained rows; update their ``log_z`` in place.

    ``power_logits [n, V]`` are alpha * l / T_t at the bonus position and ``log_z [n]``
    their log normalizer relative to p^alpha (``logsumexp(alpha l) - alpha logsumexp(l)``);
    for a constrained row it becomes the log of the allowed mass of p^alpha.
    """
    rows = [
        i
        for i, b in enumerate(blocks)
        if b.constraint is not None and b.constraint.mode == "proposal" and not b.stops
    ]
    if not rows:
        return power_logits
    pairs = [
        (blocks[i].constraint.constraint, blocks[i].constraint.context + tuple(blocks[i].kept_tokens))
        for i in rows
    ]
    out = power_logits.clone()
    for i, mask in zip(rows, _masks(pairs)):
        mask = mask.to(out.device)
        full = torch.logsumexp(out[i], -1)
        out[i] = out[i].masked_fill(~mask, -math.inf)
        allowed = torch.logsumexp(out[i], -1)
        log_z[i] = log_z[i] + allowed - full  # allowed share of the power's mass
        if not torch.isfinite(allowed):
            out[i] = power_logits[i]  # keeps sampling well defined; the row dies by weight
    return out

"""Tree attention on a batched backend: verify a whole token tree in ONE target forward.

A tree of T nodes per row is given by ``tokens [R, T]`` and ``parents [R, T]``
(``-1`` = a root that follows the cached prefix; otherwise ``parents[j] < j``).
Each node attends to its row's real prefix and to its own ancestors, at position
id ``n_real + depth``, so its logits equal those of its root-to-node path fed
alone. Afterwards ``keep_path`` keeps one root-to-node path per row (moved to the
front of the tree's columns); the rest is forgotten.

Both are methods of the backends (``TreeOps``, mixed into ``HFBatchedLM`` and
``MockLM``): this module checks the tree and its ancestors once, and each backend
writes its own state. ``HFBatchedLM`` writes the nodes after each row's tokens in
its preallocated cache and runs one forward with a custom 4D mask (``backends.kv``):
transformers 5.24's ``masking_utils`` returns any 4D mask as-is. ``MockLM``
enumerates each node's path exactly, so the decoding loops built on tree attention
can be checked by enumeration too.
"""

from __future__ import annotations

import torch


def ancestors(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``anc [R, T, T]``: ``anc[r, i, j]`` is True when node j is node i or one of its ancestors."""
    r, t = parents.shape
    if bool(((parents >= torch.arange(t, device=parents.device)) & valid).any()):
        raise ValueError("every parent must come before its child (parents[j] < j)")
    eye = torch.eye(t, dtype=torch.bool, device=parents.device).expand(r, t, t)
    has_parent = valid & (parents >= 0)
    step = torch.zeros(r, t, t + 1, dtype=torch.bool, device=parents.device)
    step.scatter_(2, torch.where(has_parent, parents, t)[..., None], True)
    anc = eye | step[..., :t]
    # Transitive closure by repeated squaring: log2(depth) small matmuls.
    for _ in range(max(1, (t - 1).bit_length())):
        nxt = anc | (torch.bmm(anc.float(), anc.float()) > 0)
        if torch.equal(nxt, anc):
            break
        anc = nxt
    return anc & (valid[:, None, :] | eye)


def kept_first(keep: torch.Tensor) -> torch.Tensor:
    """``order [R, T]``: each row's kept nodes first, in index order (ancestors before descendants)."""
    return torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)


class TreeOps:
    """``extend_tree`` and ``keep_path`` for a backend; it writes its state in two hooks.

    ``_tree_logits(tokens, anc, depth, valid)`` feeds the checked tree (on the backend's
    device) and returns its logits; ``_keep_nodes(keep)`` keeps the nodes ``keep [R, T]``.
    """

    def extend_tree(
        self,
        tokens: torch.Tensor,  # [R, T]
        parents: torch.Tensor,  # [R, T] parent node index, -1 for roots
        valid: torch.Tensor | None = None,  # [R, T] False = padding node
    ) -> torch.Tensor:
        """Feed a token tree per row in one forward; logits ``[R, T, V]`` (float32).

        The tree's columns are appended as holes; call ``keep_path`` before any other
        backend operation to keep the accepted path.
        """
        if tokens.dim() != 2 or tokens.shape != parents.shape or tokens.shape[0] != self.n_rows:
            raise ValueError(f"tokens and parents must both be [{self.n_rows}, T], got {list(tokens.shape)}")
        tokens, parents = tokens.to(self.device), parents.to(self.device)
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.to(self.device)
        anc = ancestors(parents, valid)  # [R, T, T]
        return self._tree_logits(tokens, anc, anc.sum(-1) - 1, valid)

    def keep_path(self, keep: torch.Tensor) -> None:
        """Keep the tree nodes ``keep [R, T]`` (a root-to-node path per row, possibly empty).

        The kept nodes move to the front of the tree's columns in index order (an
        ancestor precedes its descendants, so positions stay consecutive) and join the
        row; the other nodes are forgotten.
        """
        if keep.dim() != 2 or keep.shape[0] != self.n_rows:
            raise ValueError(f"keep must be [{self.n_rows}, T], got {list(keep.shape)}")
        self._keep_nodes(keep)

"""Tree attention on a batched backend: verify a whole token tree in ONE target forward.

A tree of T nodes per row is given by ``tokens [R, T]`` and ``parents [R, T]``
(``-1`` = a root that follows the cached prefix; otherwise ``parents[j] < j``).
Each node attends to its row's real prefix and to its own ancestors, at position
id ``n_real + depth``, so its logits equal those of its root-to-node path fed
alone. Afterwards ``keep_path`` keeps one root-to-node path per row (moved to the
front of the tree's columns); the rest is forgotten.

On ``HFBatchedLM`` the nodes are written after each row's tokens in its
preallocated cache and the forward takes a custom 4D mask (``backends.kv``):
transformers 5.24's ``masking_utils`` returns any 4D mask as-is. The mock LM (any backend with
``next_logits``) is served by exact path enumeration, so the decoding loops
built on this module can be checked by enumeration too.
"""

from __future__ import annotations

import torch

from . import kv
from .base import BatchedLM, Timer, to_device
from .hf import HFBatchedLM


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


def extend_tree(
    lm: BatchedLM,
    tokens: torch.Tensor,  # [R, T]
    parents: torch.Tensor,  # [R, T] parent node index, -1 for roots
    valid: torch.Tensor | None = None,  # [R, T] False = padding node
) -> torch.Tensor:
    """Feed a token tree per row in one forward; logits ``[R, T, V]`` (float32).

    The tree's columns are appended as holes; call ``keep_path`` before any other
    backend operation to keep the accepted path.
    """
    if tokens.dim() != 2 or tokens.shape != parents.shape or tokens.shape[0] != lm.n_rows:
        raise ValueError(f"tokens and parents must both be [{lm.n_rows}, T], got {list(tokens.shape)}")
    device = lm.device
    tokens, parents = tokens.to(device), parents.to(device)
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.to(device)
    anc = ancestors(parents, valid)  # [R, T, T]
    depth = anc.sum(-1) - 1
    if hasattr(lm, "next_logits"):
        return _enumerated(lm, tokens, anc, valid)
    if not isinstance(lm, HFBatchedLM):
        raise ValueError(f"tree attention needs HFBatchedLM or the mock LM, got {type(lm).__name__}")
    return _tree_forward(lm, tokens, anc, depth)


def _tree_forward(
    lm: HFBatchedLM, tokens: torch.Tensor, anc: torch.Tensor, depth: torch.Tensor
) -> torch.Tensor:
    if lm.cache is None:
        raise ValueError(f"{lm.name}: extend_tree() before prefill()")
    r, t = tokens.shape
    if max(lm.bound, default=0) + t > lm.max_length:
        raise ValueError(f"{lm.name}: the tree would pass the model's context of {lm.max_length}")
    width = max(lm.bound, default=0) + t
    try:
        lm.reserve(r, width)
    except ValueError as err:
        raise ValueError(
            f"{lm.name}: KV cache for the tree would pass max_cache_bytes; use a smaller tree"
        ) from err
    dest, allowed = kv.tree_plan(lm.lengths, anc, width)
    mask = kv.attention_mask(allowed, lm.model)
    lm.cache.plan(dest, width)
    lm.tree_width = t  # the nodes sit after each row's tokens until keep_path
    with Timer(lm.stats, lm.device, r * t), torch.inference_mode():
        out = lm.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=lm.lengths[:, None] + depth,
            use_cache=True,
            **{lm.cache_kw: lm.cache},
        )
        logits = out.logits.float()
        lm.nonfinite |= torch.isnan(logits).any()
    return logits


def _enumerated(lm, tokens: torch.Tensor, anc: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mock LM: each node's logits from its explicit root-to-node path; the columns stay holes."""
    prefixes = [lm.history[i][lm.rows.valid[i]].tolist() for i in range(lm.n_rows)]
    r, t = tokens.shape
    out = torch.zeros(r, t, lm.vocab_size)
    with Timer(lm.stats, lm.device, r * t):
        lm.history = torch.cat([lm.history, tokens], 1)
        lm.rows.append(torch.zeros_like(valid))
        for i in range(r):
            for j in range(t):
                if valid[i, j]:
                    path = tokens[i][anc[i, j]].tolist()  # ancestors in index order = root first
                    out[i, j] = lm.next_logits(prefixes[i] + path)
    return out


def keep_path(lm: BatchedLM, keep: torch.Tensor) -> None:
    """Keep the tree nodes ``keep [R, T]`` (a root-to-node path per row, possibly empty).

    The kept nodes move to the front of the tree's columns in index order (an
    ancestor precedes its descendants, so positions stay consecutive) and join the
    row; the other nodes are forgotten.
    """
    r, t = keep.shape
    if isinstance(lm, HFBatchedLM):
        if r != lm.n_rows or t != lm.tree_width:
            raise ValueError("keep_path() must directly follow extend_tree() with the same tree width")
        _keep_in_cache(lm, keep)
        return
    if t > lm.rows.length or r != lm.n_rows:
        raise ValueError(f"keep must be [{lm.n_rows}, T<={lm.rows.length}], got {list(keep.shape)}")
    if bool(lm.rows.valid[:, -t:].any()):
        raise ValueError("keep_path() must directly follow extend_tree() with the same tree width")
    order = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)  # [R, T] kept first
    n = keep.sum(1)
    start = lm.rows.length - t
    tail = lm.history[:, start:].gather(1, order)
    lm.history = torch.cat([lm.history[:, :start], tail], 1)
    kept_cols = torch.arange(t)[None, :] < n[:, None]
    lm.rows.valid = torch.cat([lm.rows.valid[:, :start], kept_cols], 1)
    lm.rows.n_real = lm.rows.n_real + n
    lm.drop_tail(torch.zeros(r, dtype=torch.long))  # dropping nothing lets the backend compact holes


@torch.inference_mode()
def _keep_in_cache(lm: HFBatchedLM, keep: torch.Tensor) -> None:
    """Move each row's kept nodes to its next columns, in order; the row grows by their number."""
    r, t = keep.shape
    host_n = keep.sum(1).tolist() if kv.on_host(keep) else [t] * r
    keep = to_device(keep, lm.device)
    order = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)  # [R, T] kept first
    cols = lm.lengths[:, None] + order  # where each node is now
    dest = lm.lengths[:, None] + torch.arange(t, device=lm.device)[None, :]

    def move(x: torch.Tensor) -> torch.Tensor:
        shape = (r, x.shape[1], t, x.shape[3])
        nodes = x.gather(2, cols[:, None, :, None].expand(shape))
        return x.scatter_(2, dest[:, None, :, None].expand(shape), nodes)

    lm.cache.map(move)
    lm.lengths = lm.lengths + keep.sum(1)
    lm.bound = [b + n for b, n in zip(lm.bound, host_n)]
    lm.tree_width = 0

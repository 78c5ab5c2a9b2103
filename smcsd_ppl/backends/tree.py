"""Tree attention on a batched backend: verify a whole token tree in ONE target forward.

A tree of T nodes per row is given by ``tokens [R, T]`` and ``parents [R, T]``
(``-1`` = a root that follows the cached prefix; otherwise ``parents[j] < j``).
Each node attends to its row's real prefix and to its own ancestors, at position
id ``n_real + depth``, so its logits equal those of its root-to-node path fed
alone. Afterwards ``keep_path`` keeps one root-to-node path per row (moved to the
front of the tree's columns) and turns the rest into holes the backend crops.

On ``HFBatchedLM`` the forward takes a custom 4D mask: transformers 5.24's
``masking_utils`` returns any 4D mask as-is; SDPA reads a bool mask (True =
attend), eager attention an additive float one. The mock LM (any backend with
``next_logits``) is served by exact path enumeration, so the decoding loops
built on this module can be checked by enumeration too.
"""

from __future__ import annotations

import torch

from .base import BatchedLM, Timer, check_logits
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
    device = lm.rows.valid.device
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
    if int((lm.rows.n_real + depth.max(1).values).max()) + 1 > lm.max_length:
        raise ValueError(f"{lm.name}: the tree would pass the model's context of {lm.max_length}")
    if lm.bytes_per_token * r * (lm.rows.length + t) > lm.max_cache_bytes:
        raise ValueError(f"{lm.name}: KV cache for the tree would pass max_cache_bytes; use a smaller tree")
    prefix = lm.rows.valid[:, None, :].expand(r, t, -1)
    allowed = torch.cat([prefix, anc], 2)[:, None]  # [R, 1, T, L + T]
    impl = getattr(lm.model.config, "_attn_implementation", "sdpa")
    if impl == "eager":
        dtype = next(lm.model.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    elif impl == "sdpa":
        mask = allowed
    else:
        raise ValueError(f"tree attention needs attn_implementation 'sdpa' or 'eager', not {impl!r}")
    positions = lm.rows.n_real[:, None] + depth
    lm.rows.append(torch.zeros_like(tokens, dtype=torch.bool))  # holes until keep_path
    with Timer(lm.stats, lm.device, r * t), torch.inference_mode():
        out = lm.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{lm.cache_kw: lm.cache},
        )
    return check_logits(out.logits.float(), lm.name)


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
    ancestor precedes its descendants, so positions stay consecutive); the other
    columns become holes, and the backend crops or compacts them as usual.
    """
    r, t = keep.shape
    if t > lm.rows.length or r != lm.n_rows:
        raise ValueError(f"keep must be [{lm.n_rows}, T<={lm.rows.length}], got {list(keep.shape)}")
    keep = keep.to(lm.rows.valid.device)
    if bool(lm.rows.valid[:, -t:].any()):
        raise ValueError("keep_path() must directly follow extend_tree() with the same tree width")
    order = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)  # [R, T] kept first
    n = keep.sum(1)
    start = lm.rows.length - t

    def move(x: torch.Tensor, dim: int) -> torch.Tensor:
        shape = [1] * x.dim()
        shape[0], shape[dim] = r, t
        index = order.view(shape).expand(*x.shape[:dim], t, *x.shape[dim + 1 :])
        tail = x.narrow(dim, start, t).gather(dim, index)
        return torch.cat([x.narrow(dim, 0, start), tail], dim)

    with torch.inference_mode():
        if isinstance(lm, HFBatchedLM):
            lm.map_cache(lambda x: move(x, 2))  # [R, heads, L, head_dim]
        else:
            lm.history = move(lm.history, 1)
    kept_cols = torch.arange(t, device=keep.device)[None, :] < n[:, None]
    lm.rows.valid = torch.cat([lm.rows.valid[:, :start], kept_cols], 1)
    lm.rows.n_real = lm.rows.n_real + n
    lm.drop_tail(torch.zeros(r, dtype=torch.long))  # dropping nothing lets the backend crop holes

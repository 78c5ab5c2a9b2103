"""A feed whose rows hold unlike counts of real tokens, as one forward of those tokens alone.

Left-padded, such a feed computes every hole; split by count, it pays a forward per count (on
a CPU, a read of every weight each). Flattened, it is neither: the model's position-wise layers
(embeddings, norms, linear layers, the head) read the real tokens as one sequence ``[1, P]``,
and only attention, which needs each row's own cache columns, puts the queries back in the
padded layout ``[n, T]``, attends under the feed's mask as a padded forward would, and
flattens the result again. This is the model's own SDPA attention, reached through the
attention interface of transformers under the name ``NAME``: any forward that does not pass
``rows_valid`` (``generate``, a padded forward) is exactly SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "smcsd_rows"


def rows_attention(module, query, key, value, attention_mask, *, rows_valid=None, **kwargs):
    """SDPA; with ``rows_valid [n, T]``, ``query [1, heads, P, dim]`` holds the feed's real tokens, flattened.

    ``key``, ``value`` ``[n, kv_heads, W, dim]`` and ``attention_mask [n, 1, T, W]`` are the padded
    feed's. Returns ``[1, P, heads, dim]`` (``[B, T, heads, dim]`` without ``rows_valid``).
    """
    if rows_valid is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    n, t = rows_valid.shape
    padded = query.new_zeros(n, t, query.shape[1], query.shape[3])
    padded[rows_valid] = query[0].transpose(0, 1)
    out, _ = sdpa_attention_forward(module, padded.transpose(1, 2), key, value, attention_mask, **kwargs)
    return out[rows_valid][None], None


def route_attention(model: torch.nn.Module) -> bool:
    """Route ``model``'s attention through ``rows_attention`` where it is SDPA, through the interface.

    Sets the attention implementation of ``model``'s configs to ``NAME`` (SDPA for every forward
    that is not flattened); returns whether its feeds may now run flattened.
    """
    # Every module's config: a model built from parts may hold several.
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    impls = {getattr(c, "_attn_implementation", None) for c in configs.values()}
    if not getattr(model, "_supports_attention_backend", False) or not impls <= {"sdpa", NAME}:
        return False
    AttentionInterface.register(NAME, rows_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    for config in configs.values():
        config._attn_implementation = NAME
    return True


def flat_group(valid: torch.Tensor) -> list[tuple[int, torch.Tensor]] | None:
    """Every fed row of a left-padded feed ``valid [R, T]`` as one group ``(widest count, rows)``.

    None where the fed rows hold alike counts: they pad nothing, and run as they are.
    """
    counts = valid.sum(1)
    fed = (counts > 0).nonzero(as_tuple=True)[0]
    if not fed.numel() or bool((counts[fed] == counts[fed[0]]).all()):
        return None
    return [(int(counts.max()), fed)]


def flattened(valid: torch.Tensor, index: torch.Tensor | None, *padded: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``padded`` (``[n, T]``: ids, cache columns, positions) at the real tokens, ``[1, P]``.

    Then each real token's backend row: ``index [n]`` holds the feed's rows (None: row i is row i).
    """
    rows = torch.arange(valid.shape[0], device=valid.device) if index is None else index
    return [x[valid][None] for x in (*padded, rows[:, None].expand(valid.shape))]


def scatter(flat: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``flat [P, ...]`` (the real positions of ``valid [n, T]``, in order) in the padded layout; holes 0."""
    out = flat.new_zeros(*valid.shape, *flat.shape[1:])
    out[valid] = flat
    return out

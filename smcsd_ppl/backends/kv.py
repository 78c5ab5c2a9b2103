"""A preallocated KV cache with one write position per row.

Every layer holds keys and values ``[R, heads, C, head_dim]`` allocated ahead of time
(capacity C, grown by doubling when a forward needs more). Row r's real tokens fill
columns ``[0, length[r])`` in order, so rows never hold holes:

- a forward writes each row's real tokens at ``length[r], length[r] + 1, ...`` and its
  holes (left padding, rows that sit a step out) after them, where the next forward
  overwrites them;
- dropping a row's tail moves ``length[r]`` back; nothing is copied;
- a fork copies rows (in place when the row count stays or falls: requests leaving keep the buffers).

Attention reads columns ``[0, width)`` through one 4D mask per forward (shared by all
layers), built on the device from the lengths: no per-forward host read, no
``torch.cat`` of the whole cache.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import ragged
from .base import to_device


class RowLayer(CacheLayerMixin):
    """One layer's preallocated keys and values; writes go where the owning cache says."""

    is_sliding = False

    def __init__(self, owner: RowCache) -> None:
        super().__init__()
        # Weak: a layer pointing back at the cache that holds it is a reference cycle, and a
        # cycle frees the buffers only at a full garbage collection, dozens of calls later.
        self._owner = weakref.ref(owner)

    @property
    def owner(self) -> RowCache:
        """The cache this layer belongs to."""
        return self._owner()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate zeroed buffers at the owner's capacity (zeros: masked columns stay finite)."""
        r, heads, _, dim = key_states.shape
        self.keys = key_states.new_zeros(r, heads, self.owner.capacity, dim)
        self.values = value_states.new_zeros(r, heads, self.owner.capacity, value_states.shape[-1])
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Scatter the new states ``[R, heads, T, dim]`` to their columns; return the first ``width``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # index_put_ on [R, C, heads, dim] views writes only the new tokens (scatter_ on CPU
        # copied the whole buffer).
        rows, dest = self.owner.rows, self.owner.dest  # [R, 1] and [R, T], or [1, P] both
        self.keys.transpose(1, 2).index_put_((rows, dest), key_states.transpose(1, 2))
        self.values.transpose(1, 2).index_put_((rows, dest), value_states.transpose(1, 2))
        width, subset = self.owner.width, self.owner.subset
        if subset is not None:  # a forward of some rows reads theirs alone
            return self.keys[:, :, :width].index_select(0, subset), self.values[:, :, :width].index_select(
                0, subset
            )
        return self.keys[:, :, :width], self.values[:, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Columns attention reads (the mask is always given in 4D, so this is informative)."""
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        """Columns attention reads."""
        return self.owner.width

    def get_max_length(self) -> int:
        """The preallocated capacity."""
        return self.owner.capacity


class RowCache(Cache):
    """Layers of ``RowLayer``; ``dest`` and ``width`` are set by the backend before each forward."""

    def __init__(self, capacity: int) -> None:
        super().__init__(layers=[])
        self.capacity = capacity
        self.dest: torch.Tensor | None = None  # [R, T] column of each fed token
        self.rows: torch.Tensor | None = None  # [R, 1] row index, broadcast against dest
        self.subset: torch.Tensor | None = None  # the rows a forward of some rows runs (None: all)
        self.width = 0

    def plan(
        self,
        dest: torch.Tensor,
        width: int,
        subset: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Where the next forward writes (``dest [n, T]``), how many columns it reads, and for which rows.

        ``subset [n]``: the rows of a forward that runs only those (None: every row, in order).
        ``rows``: the row of each token, where the tokens come flattened (``dest`` and ``rows``
        then ``[1, P]``, see ``backends.ragged``); None: row i of ``dest`` is ``subset[i]``.
        """
        self.dest, self.width, self.subset = dest, width, subset
        if rows is None:
            rows = (torch.arange(dest.shape[0], device=dest.device) if subset is None else subset)[:, None]
        self.rows = rows

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write one layer's new states (layers are created on first use)."""
        while len(self.layers) <= layer_idx:
            self.layers.append(RowLayer(self))
        return self.layers[layer_idx].update(key_states, value_states)

    @property
    def nbytes(self) -> int:
        """Bytes the keys and values of every allocated layer hold (their whole buffers)."""
        return sum(
            x.untyped_storage().nbytes()
            for layer in self.layers
            if layer.is_initialized
            for x in (layer.keys, layer.values)
        )

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every allocated key and value buffer ``[R, heads, C, dim]`` by ``fn`` of it."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)

    def grow(self, capacity: int) -> None:
        """Enlarge every buffer to ``capacity`` columns (one copy; amortised by doubling)."""
        extra = capacity - self.capacity
        if extra > 0:
            self.map(lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.shape[3])], 2))
            self.capacity = capacity

    def concat(self, other: RowCache) -> RowCache:
        """This cache's rows, then ``other``'s, at the larger capacity (``other`` holds as many layers)."""
        capacity = max(self.capacity, other.capacity)
        self.grow(capacity)
        other.grow(capacity)
        for mine, theirs in zip(self.layers, other.layers):
            mine.keys = torch.cat([mine.keys, theirs.keys])
            mine.values = torch.cat([mine.values, theirs.values])
        return self

    def fork(self, rows: torch.Tensor, host_rows: list[int] | None, used: int, capacity: int) -> None:
        """Keep rows ``rows [R']`` in order; only the first ``used`` columns are copied.

        The same count, or fewer at the same capacity (requests leaving a batch), copies in
        place and keeps the buffers' first rows; more rows reallocate at ``capacity`` columns.
        """
        n_old = self.layers[0].keys.shape[0] if self.layers and self.layers[0].is_initialized else 0
        n = len(rows)
        if n > n_old or (n < n_old and capacity != self.capacity):
            self.map(lambda t: _gathered(t, rows, used, capacity))
            self.capacity = capacity
            return
        if host_rows is not None:  # resampling usually replaces a few rows: copy only those
            moved = [(d, s) for d, s in enumerate(host_rows) if d != s]
            dest = to_device(torch.tensor([d for d, _ in moved], dtype=torch.long), rows.device)
            src = to_device(torch.tensor([s for _, s in moved], dtype=torch.long), rows.device)
        else:
            dest, src = torch.arange(n, device=rows.device), rows
        if len(dest):
            self.map(lambda t: _copy_rows(t, dest, src, used))
        if n < n_old:  # the first rows of the same buffers
            self.map(lambda t: t[:n])

    def copy_columns(self, dest: torch.Tensor, src: torch.Tensor, cols: torch.Tensor) -> None:
        """Columns ``cols [n, T]`` of rows ``src [n]`` written to the same columns of rows ``dest [n]``."""
        for layer in self.layers:
            if layer.is_initialized:
                for t in (layer.keys, layer.values):
                    view = t.transpose(1, 2)  # [R, C, heads, dim]
                    view.index_put_((dest[:, None], cols), view[src[:, None], cols])


def _copy_rows(t: torch.Tensor, dest: torch.Tensor, src: torch.Tensor, used: int) -> torch.Tensor:
    head = t[:, :, :used]
    head.index_copy_(0, dest, head.index_select(0, src))
    return t


def _gathered(t: torch.Tensor, rows: torch.Tensor, used: int, capacity: int) -> torch.Tensor:
    out = t.new_zeros(len(rows), t.shape[1], capacity, t.shape[3])
    out[:, :, :used] = t[:, :, :used].index_select(0, rows)
    return out


@dataclass(frozen=True)
class Feed:
    """A forward's feed as the backend planned it, for the model's forward to read.

    Attributes:
        positions: each token's position id (``[n, T]``, or ``[1, P]`` where ``flat``).
        allowed: ``[n, 1, T, W]`` what each token attends to (True = attend).
        cache: the rows, planned (``RowCache.plan``): where each layer writes, which rows it reads.
        flat: ``[n, T]`` bool where the ids are the feed's real tokens alone, flattened ``[1, P]``
            in this order (``backends.ragged``); None: the ids are the padded ``[n, T]`` feed.
    """

    positions: torch.Tensor
    allowed: torch.Tensor
    cache: RowCache
    flat: torch.Tensor | None = None


def plan(
    length: torch.Tensor,  # [R] real tokens each row holds
    valid: torch.Tensor,  # [R, T] False = hole
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a forward's tokens go and what they see.

    Returns ``dest [R, T]`` (cache column of each token: real tokens packed after the
    row's last real one, holes after those), ``positions [R, T]`` (holes reuse the next
    free id) and ``allowed [R, 1, T, width]`` (True = attend): a real token sees its
    row's real prefix, the earlier real tokens of the block and itself; a hole sees
    only itself, so no row of the softmax is empty.
    """
    v = valid.long()
    before = v.cumsum(1) - v
    holes_before = (1 - v).cumsum(1) - (1 - v)
    start = length[:, None]
    dest = torch.where(valid, start + before, start + v.sum(1, keepdim=True) + holes_before)
    cols = torch.arange(width, device=valid.device)[None, None, :]
    sees = torch.where(valid[:, :, None], cols <= dest[:, :, None], cols == dest[:, :, None])
    return dest, start + before, sees[:, None]


def tree_plan(
    length: torch.Tensor,  # [R]
    anc: torch.Tensor,  # [R, T, T] node j is node i or an ancestor of it
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dest [R, T]`` and ``allowed [R, 1, T, width]`` for a token tree written after each row."""
    r, t = anc.shape[:2]
    dest = length[:, None] + torch.arange(t, device=anc.device)[None, :]
    cols = torch.arange(width, device=anc.device)
    prefix = (cols[None, :] < length[:, None])[:, None, :].expand(r, t, width)
    allowed = prefix.clone()
    allowed.scatter_(2, dest[:, None, :].expand(r, t, t), anc)  # a node sees its ancestors' columns
    return dest, allowed[:, None]


def attention_mask(allowed: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """The 4D mask the model's attention takes: bool for SDPA, additive float for eager."""
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl in ("sdpa", ragged.NAME):
        return allowed
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"the batched backend needs attn_implementation 'sdpa' or 'eager', not {impl!r}")


def on_host(t: torch.Tensor) -> bool:
    """Whether reading ``t`` is free (it lives in host memory); otherwise it would be a sync."""
    return t.device.type == "cpu"


def host_counts(valid: torch.Tensor, rows: int, t: int) -> list[int]:
    """Real tokens per row when ``valid`` is on the host; else ``t`` (an upper bound, no read)."""
    return valid.sum(1).tolist() if on_host(valid) else [t] * rows


def cache_keyword(model: torch.nn.Module) -> str:
    """The cache argument's name: ``cache`` since transformers 5.24, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes one row's KV cache grows by per position (keys + values, all layers)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * heads * head_dim * elem

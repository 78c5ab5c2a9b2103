"""Batched backend over any Hugging Face causal LM with a preallocated KV cache per row."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from . import cpu, kv, ragged
from .base import (
    BatchedLM,
    CacheExhausted,
    ForwardStats,
    Timer,
    length_groups,
    nan_logits,
    pad_left,
    pad_left_hidden,
    to_device,
)
from .kv import Feed, RowCache, plan
from .llama import LlamaForward
from .reference import ReferenceForward
from .tree import TreeOps, kept_first
from .twins import RowContents, TwinFeeds, feed_groups, tree_counts

DEFAULT_CACHE_BUDGET = 8 * 2**30  # bytes of KV cache one backend may hold
HEADROOM = 32  # columns past a forward's need: a few cycles' worth (rows x columns is the memory)


class HFBatchedLM(BatchedLM, TreeOps, TwinFeeds):
    """Rows of one HF model's preallocated KV cache; particles live in the batch dimension.

    Row lengths live on the device (``lengths``) for masks and position ids; the host
    keeps an upper bound per row (exact whenever the caller's masks are on the host),
    enough to size forwards without reading the device.

    Args:
        model: a causal LM in eval mode (any device and dtype).
        max_cache_bytes: refuse (``ValueError``) a forward whose KV cache would exceed this.
        name: used in error messages.
        compiled: our forward of a Llama model (``llama.LlamaForward``), run instead of the
            model's own; None: the model's own forward, the reference.
        tricks: what it does because a CPU pays for every row (``cpu.CPUTricks``; default: all
            of them on a CPU, none elsewhere).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_cache_bytes: int = DEFAULT_CACHE_BUDGET,
        name: str = "model",
        compiled: LlamaForward | None = None,
        tricks: cpu.CPUTricks | None = None,
    ) -> None:
        self.model = model
        # What a forward runs: ours (``llama``) where given, else the model's own (the reference).
        self.model_forward = compiled if compiled is not None else ReferenceForward(model)
        self.name = name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_length = int(getattr(model.config, "max_position_embeddings", 2048))
        self.max_cache_bytes = max_cache_bytes
        self.bytes_per_token = kv.bytes_per_token(model)
        self.n_params = sum(p.numel() for p in model.parameters())  # what a forward reads
        # What one verified row-position costs, when this CPU makes it dearer than usual.
        self.row_position_cost = cpu.row_position_cost(self.dtype) if self.device.type == "cpu" else None
        self.stats = ForwardStats()
        self.cache: RowCache | None = None
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [R] real tokens per row
        self.bound: list[int] = []  # per row, >= lengths (host; exact when masks come from the host)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)  # NaN seen since last check
        self.tree_width = 0  # columns of an unsettled extend_tree (keep_path settles them)
        self.tree_fed: list[list[int]] | None = None  # its tokens, where they were read for free
        self.contents = RowContents()  # each row's tokens: rows holding the same compute once
        if tricks is None:
            tricks = cpu.CPUTricks() if self.device.type == "cpu" else cpu.NO_TRICKS
        self.shares_twins = tricks.twins  # reading what is fed is free on a CPU only
        # A feed of unlike counts may run flattened, as one forward (``backends.ragged``).
        self.flattens = tricks.flatten and self.model_forward.flattens
        # A feature draft reads the target's hidden states with its tokens; a target
        # serving one keeps the hidden states of its last forward (`keep_hidden_states`).
        self.reads_hidden = bool(getattr(model, "reads_hidden", False))
        self.keeps_hidden = self.reads_hidden
        self.hidden: torch.Tensor | None = None  # [R, T, H] of the last forward, when kept

    @property
    def compiled(self) -> LlamaForward | None:
        """Our forward of the model, or None where it runs its own."""
        return self.model_forward if isinstance(self.model_forward, LlamaForward) else None

    @property
    def n_rows(self) -> int:
        """Rows currently held."""
        return len(self.bound)

    @property
    def cache_bytes(self) -> int:
        """Bytes the KV cache holds now (its capacity, for every row held)."""
        return self.cache.nbytes if self.cache is not None else 0

    def release(self) -> None:
        """Drop every row and free the KV cache (the next ``prefill`` starts afresh)."""
        self.cache, self.hidden, self.tree_width = None, None, 0
        self.lengths, self.bound, self.contents = self.lengths.new_zeros(0), [], RowContents()

    def _prefill(self, prompts: Sequence[Sequence[int]], hidden) -> torch.Tensor:
        """``BatchedLM.prefill``: prompts of like lengths left-padded together, a forward per group.

        One padded forward computes every prompt at the longest one's length: for a batch of
        a 30-token question and a 1,000-token article, 97% of the question's row is padding.
        """
        groups = length_groups([len(p) for p in prompts])
        if len(groups) == 1 or hidden is not None or self.keeps_hidden:  # states stay one padded block
            return self._prefill_padded(prompts, hidden)
        logits = [self._prefill_padded([prompts[i] for i in groups[0]], None)]
        logits += [self._append([prompts[i] for i in g]) for g in groups[1:]]
        back = torch.argsort(torch.tensor([i for g in groups for i in g]))  # prompt i back on row i
        self.fork(back)
        return torch.cat(logits).index_select(0, back.to(logits[0].device))

    def _prefill_padded(self, prompts: Sequence[Sequence[int]], hidden) -> torch.Tensor:
        """The prompts left-padded, one forward, the rows held before dropped."""
        ids, valid = pad_left(prompts)
        if hidden is not None:
            hidden = pad_left_hidden(hidden, ids.shape[1]).to(self.device)
        self.cache = RowCache(0)
        self.lengths = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
        self.bound = [0] * len(prompts)
        self.contents = RowContents(len(prompts))
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        self.tree_width = 0
        return self._forward(ids, valid, last_only=True, hidden=hidden)[:, -1]

    def _append(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """``BatchedLM.append``: the prompts prefilled alone, their cache rows put after the held ones."""
        if self.reads_hidden:
            raise ValueError(f"{self.name}: a feature draft cannot take rows joining a running batch")
        held = self.cache, self.lengths, self.bound, self.nonfinite, self.contents
        logits = self._prefill(prompts, None)
        self.contents.held = held[4].held + self.contents.held
        self.cache = held[0].concat(self.cache)
        self.lengths = torch.cat([held[1], self.lengths])
        self.bound = held[2] + self.bound
        self.nonfinite = self.nonfinite | held[3]
        return logits

    def _extend(self, tokens: torch.Tensor, valid, hidden, vocab) -> torch.Tensor:
        """``BatchedLM.extend``'s forward; with ``vocab`` the LM head reads those tokens' rows only.

        On a CPU a forward costs every position it carries, holes included, and a read of every
        weight. A left-padded feed whose rows hold unlike counts of real tokens (blocks of unlike
        lengths, rows that ask nothing) runs its real tokens alone, flattened, in one forward
        (``backends.ragged``); a model that cannot, as a forward per count where padding costs
        more (``feed_groups``). Rows fed nothing sit out. It counts as one call.
        """
        if valid is None:
            valid = torch.ones(tokens.shape, dtype=torch.bool)
        groups = None
        if hidden is None and not self.keeps_hidden and vocab is None:
            groups = feed_groups(valid, self.row_position_cost or cpu.NATIVE_ROW_POSITION_COST)
        if groups is not None:
            flat = ragged.flat_group(valid) if self.flattens else None  # one forward, no holes
            return self._grouped(tokens, valid, flat or groups, flat is not None)
        if hidden is not None:
            hidden = hidden.to(self.device)
        return self._forward(
            tokens,
            valid,
            last_only=False,
            hidden=hidden,
            vocab=None if vocab is None else to_device(vocab, self.device),
        )

    @torch.inference_mode()
    def fork(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows [R']`` in order (duplicates allowed); copies rows, in place when it can."""
        if rows.numel() == 0:
            raise ValueError(f"{self.name}: fork() needs at least one row")
        host = rows.tolist() if kv.on_host(rows) else None
        rows = to_device(rows, self.device)
        used = max(self.bound, default=0)
        self.tree_width = 0
        # More rows may not fit the old capacity within the budget: keep what fits.
        capacity = min(self.cache.capacity, self._budget_columns(rows.numel()))
        self._check_budget(rows.numel(), used)
        self.cache.fork(rows, host, used, capacity)
        self.contents.fork(host, rows.numel())
        self.lengths = self.lengths.index_select(0, rows)
        # Rows given on the device cannot be read without a sync: every row gets the largest bound.
        self.bound = [self.bound[i] for i in host] if host is not None else [used] * rows.numel()

    @torch.inference_mode()
    def drop_tail(self, n: torch.Tensor) -> None:
        """Forget the last ``n[r]`` real tokens of each row: its write position moves back."""
        if kv.on_host(n):
            drop = n.tolist()
            if any(d > b for d, b in zip(drop, self.bound)) or min(drop, default=0) < 0:
                raise ValueError(f"{self.name}: cannot drop {drop} tokens from rows holding {self.bound}")
            self.bound = [b - d for b, d in zip(self.bound, drop)]
        self.tree_width = 0
        self.contents.drop(n)
        self.lengths = self.lengths - to_device(n, self.device)

    @torch.inference_mode()
    def _tree_logits(
        self, tokens: torch.Tensor, anc: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """``TreeOps`` hook: write the nodes after each row's tokens, one forward under a tree mask.

        On a CPU, over the rows that have nodes, twins once (``TwinFeeds._tree_rows``): a row
        with none would cost as much as one with the most.
        """
        if self.cache is None:
            raise ValueError(f"{self.name}: extend_tree() before prefill()")
        r, t = tokens.shape
        width = max(self.bound, default=0) + t
        if width > self.max_length:
            raise ValueError(f"{self.name}: the tree would pass the model's context of {self.max_length}")
        try:
            self.reserve(r, width)
        except ValueError as err:
            raise ValueError(
                f"{self.name}: KV cache for the tree would pass max_cache_bytes; use a smaller tree"
            ) from err
        self.tree_width = t  # the nodes sit after each row's tokens until keep_path
        counts = tree_counts(valid) if self.shares_twins else None
        self.tree_fed = None if counts is None else tokens.tolist()  # what keep_path adds to the contents
        if counts is None:
            return self._tree_forward(tokens, anc, depth, width, None)
        return self._tree_rows(tokens, anc, depth, width, counts)

    def _tree_forward(
        self,
        tokens: torch.Tensor,
        anc: torch.Tensor,
        depth: torch.Tensor,
        width: int,
        rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """One tree forward of every row, or of ``rows [n]`` alone (the others keep still)."""
        lengths = self.lengths if rows is None else self.lengths.index_select(0, rows)
        dest, allowed = kv.tree_plan(lengths, anc, width)
        self.cache.plan(dest, width, rows)
        positions = lengths[:, None] + depth
        with Timer(self.stats, self.device, tokens.numel()):
            logits, _ = self.model_forward(tokens, Feed(positions, allowed, self.cache))
            self.nonfinite |= torch.isnan(logits).any()
        return logits

    @torch.inference_mode()
    def _keep_nodes(self, keep: torch.Tensor) -> None:
        """``TreeOps`` hook: move each row's kept nodes to its next columns, in order."""
        r, t = keep.shape
        if t != self.tree_width:
            raise ValueError("keep_path() must directly follow extend_tree() with the same tree width")
        host_n = keep.sum(1).tolist() if kv.on_host(keep) else [t] * r
        keep = to_device(keep, self.device)
        cols = self.lengths[:, None] + kept_first(keep)  # where each node is now
        dest = self.lengths[:, None] + torch.arange(t, device=self.device)[None, :]

        def move(x: torch.Tensor) -> torch.Tensor:
            shape = (r, x.shape[1], t, x.shape[3])
            nodes = x.gather(2, cols[:, None, :, None].expand(shape))
            return x.scatter_(2, dest[:, None, :, None].expand(shape), nodes)

        self.cache.map(move)
        self.lengths = self.lengths + keep.sum(1)
        self.bound = [b + n for b, n in zip(self.bound, host_n)]
        self.tree_width = 0
        if self.tree_fed is not None and kv.on_host(keep):
            self.contents.kept(self.tree_fed, keep)
        else:
            self.contents.forget(range(r))  # what was kept is not known: nobody's twin

    def check_finite(self) -> None:
        """Raise if any forward since the last check produced NaN logits (one host read)."""
        bad, self.nonfinite = bool(self.nonfinite), torch.zeros_like(self.nonfinite)
        if bad:
            raise nan_logits(self.name)

    def reserve(self, rows: int, width: int) -> None:
        """Make room for ``width`` columns: double the capacity (within the byte budget) or refuse."""
        self._check_budget(rows, width)
        if width > self.cache.capacity:
            # A few cycles' room, then doubling: growth copies stay amortised, and a short answer
            # does not hold columns for a long one (every row of the batch pays for each column).
            want = max(width + HEADROOM, 2 * self.cache.capacity)
            self.cache.grow(min(want, self._budget_columns(rows)))

    def _budget_columns(self, rows: int) -> int:
        return self.max_cache_bytes // max(1, self.bytes_per_token * rows)

    def _check_budget(self, rows: int, width: int) -> None:
        if width > self._budget_columns(rows):
            raise CacheExhausted(
                f"{self.name}: KV cache would need {self.bytes_per_token * rows * width / 2**30:.2f} GiB for "
                f"{rows} rows x {width} positions, over the budget of "
                f"{self.max_cache_bytes / 2**30:.2f} GiB; "
                "use fewer particles or tokens, or raise max_cache_bytes"
            )

    def _forward(
        self,
        ids: torch.Tensor,
        valid: torch.Tensor,
        *,
        last_only: bool,
        hidden: torch.Tensor | None = None,
        vocab: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        flat: bool = False,
    ) -> torch.Tensor:
        """One forward of every row, or of ``rows [n]`` alone (on the host; the others keep still).

        ``flat``: the real tokens alone run, flattened (``backends.ragged``); holes get logits 0.
        """
        r, t = ids.shape
        if self.reads_hidden != (hidden is not None):
            what = "needs the target's hidden states" if self.reads_hidden else "takes no hidden states"
            raise ValueError(f"{self.name}: this model {what}")
        if hidden is not None and hidden.shape[:2] != ids.shape:
            raise ValueError(f"{self.name}: hidden must be [{r}, {t}, H], got {list(hidden.shape)}")
        held = range(self.n_rows) if rows is None else rows.tolist()
        bound = list(self.bound)
        for row, c in zip(held, kv.host_counts(valid, r, t)):
            bound[row] += c
        if max(bound, default=0) > self.max_length:
            raise ValueError(
                f"{self.name}: sequence would reach {max(bound)} tokens; "
                f"the model's context is {self.max_length}"
            )
        width = self._width(max((self.bound[row] for row in held), default=0) + t + self.tree_width)
        self.reserve(self.n_rows, width)
        if self.shares_twins:
            self.contents.fed(held, ids, valid)
        else:
            self.contents.forget(held)
        ids, valid = to_device(ids, self.device), to_device(valid, self.device)
        self.tree_width = 0
        index = None if rows is None else to_device(rows, self.device)
        lengths = self.lengths if index is None else self.lengths.index_select(0, index)
        dest, positions, allowed = plan(*self._shaped(lengths, valid), width)
        row_of = None
        if flat:  # the real tokens alone, each with its row; attention takes them back to rows
            ids, dest, positions, row_of = ragged.flattened(valid, index, ids, dest, positions)
        self.cache.plan(dest, width, index, rows=row_of)
        grown = valid.sum(1)
        self.lengths = self.lengths + grown if index is None else self.lengths.index_add(0, index, grown)
        self.bound = bound
        options = dict(last_only=last_only, keep_hidden=self.keeps_hidden)
        options["vocab"] = None if vocab is None else to_device(vocab, self.device)
        if hidden is not None:
            options["read"] = hidden
        feed = Feed(positions, allowed, self.cache, valid if flat else None)
        ids = ids if flat else self._shaped_ids(ids)
        with Timer(self.stats, self.device, ids.numel()), torch.inference_mode():
            logits, self.hidden = self._run(ids, feed, options)
            self.nonfinite |= torch.isnan(logits).any()
        return logits[:r] if not flat else logits

    def _run(self, ids: torch.Tensor, feed: Feed, options: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward of a planned feed: logits and the kept states."""
        return self.model_forward(ids, feed, **options)

    # What a backend of set shapes (``fixed.ShapedLM``) changes: as they are here.
    def _width(self, needed: int) -> int:
        """The columns a forward's attention reads: what it needs."""
        return needed

    def _shaped(self, lengths: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward's row lengths and feed mask, as its rows run: as they are."""
        return lengths, valid

    def _shaped_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """A forward's ids, as its rows run: as they are."""
        return ids

"""A deterministic tiny language model for exact tests.

Its next-token logits depend only on the last ``order`` real tokens, read from a
fixed table, so the probability of any sequence can be enumerated exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import ForwardStats, RowMask, Timer, check_prompts, nan_logits, pad_left
from .tree import TreeOps, kept_first


class MockLM(TreeOps):
    """Tiny n-gram LM implementing the ``BatchedLM`` protocol (tree operations included).

    Args:
        vocab_size: V (<= 8 keeps enumeration cheap).
        order: how many previous tokens the logits depend on.
        seed: seeds the random logit table.
        scale: spread of the logits (larger = peakier distributions).
        table: explicit logits ``[V] * order + [V]``, overriding the random one.
        max_length: context limit, to exercise over-long prompt errors.
        name: used in error messages.
    """

    def __init__(
        self,
        vocab_size: int = 5,
        *,
        order: int = 2,
        seed: int = 0,
        scale: float = 1.5,
        table: torch.Tensor | None = None,
        max_length: int = 64,
        name: str = "mock model",
    ) -> None:
        if table is None:
            g = torch.Generator().manual_seed(seed)
            table = scale * torch.randn(*([vocab_size] * (order + 1)), generator=g)
        self.table = table.float()
        self.vocab_size = self.table.shape[-1]
        self.order = self.table.dim() - 1
        self.max_length = max_length
        self.name = name
        self.stats = ForwardStats()
        self.nonfinite = torch.zeros((), dtype=torch.bool)  # NaN logits seen since the last check
        self.device = torch.device("cpu")
        self.n_params = None  # unknown: the engine prices a mock draft step as a third of the target
        self.row_position_cost = 0.0  # a table lookup: more rows cost nothing
        self.bytes_per_token = 9  # a token id and its hole flag per position
        self.max_cache_bytes = 2**40  # no real budget: max_length bounds every row
        self.reads_hidden = False  # an n-gram table has no hidden states, read or kept
        self.hidden = None
        self.history = torch.zeros(0, 0, dtype=torch.long)
        self.rows = RowMask(torch.zeros(0, 0, dtype=torch.bool))

    @property
    def n_rows(self) -> int:
        """Rows currently held."""
        return self.history.shape[0]

    def release(self) -> None:
        """Drop every row (the next ``prefill`` starts afresh)."""
        self.history = torch.zeros(0, 0, dtype=torch.long)
        self.rows = RowMask(torch.zeros(0, 0, dtype=torch.bool))

    def next_logits(self, context: Sequence[int]) -> torch.Tensor:
        """Logits ``[V]`` after a token sequence (missing history reads as token 0)."""
        last = [0] * max(0, self.order - len(context)) + list(context)[-self.order :]
        return self.table[tuple(last)] if self.order else self.table

    def keep_hidden_states(self) -> None:
        """Refused: the mock has no hidden states to keep."""
        raise ValueError(f"{self.name} has no hidden states: a feature draft needs an HF target")

    def check_finite(self) -> None:
        """Raise if a forward since the last check produced NaN logits (as the HF backend, later)."""
        bad, self.nonfinite = bool(self.nonfinite), torch.zeros((), dtype=torch.bool)
        if bad:
            raise nan_logits(self.name)

    def prefill(self, prompts: Sequence[Sequence[int]], hidden: None = None) -> torch.Tensor:
        """Start afresh with one row per prompt; next-token logits ``[B, V]``."""
        _no_hidden(self, hidden)
        check_prompts(prompts, self.max_length)
        ids, valid = pad_left(prompts)
        self.history = torch.zeros(len(prompts), 0, dtype=torch.long)
        self.rows = RowMask(torch.zeros(len(prompts), 0, dtype=torch.bool))
        return self._forward(ids, valid)[:, -1]

    def append(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Add one row per prompt after the rows held; their next-token logits ``[B, V]``."""
        if self.n_rows == 0:
            return self.prefill(prompts)
        held, mask = self.history, self.rows
        logits = self.prefill(prompts)
        width = max(held.shape[1], self.history.shape[1])
        pad = lambda t, fill: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)  # noqa: E731
        self.history = torch.cat([pad(held, 0), pad(self.history, 0)])
        self.rows = RowMask(torch.cat([pad(mask.valid, False), pad(self.rows.valid, False)]))
        return logits

    def extend(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor | None = None,
        hidden: None = None,
        *,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``tokens [R, T]``; logits ``[R, T, V]`` (``[R, T, U]`` for the tokens ``vocab [U]``)."""
        _no_hidden(self, hidden)
        if tokens.dim() != 2 or tokens.shape[0] != self.n_rows:
            raise ValueError(f"tokens must be [{self.n_rows}, T], got {list(tokens.shape)}")
        out = self._forward(tokens, torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid)
        return out if vocab is None else out.index_select(-1, vocab)

    def fork(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows [R']`` in order."""
        self.history = self.history.index_select(0, rows)
        self.rows.gather(rows)

    def drop_tail(self, n: torch.Tensor) -> None:
        """Turn the last ``n[r]`` real positions of each row into holes."""
        self.rows.drop_tail(n)
        if self.rows.wasteful():
            self.history = self.history.gather(1, self.rows.compaction())

    def _tree_logits(
        self, tokens: torch.Tensor, anc: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """``TreeOps`` hook: each node's logits from its root-to-node path; the columns stay holes."""
        prefixes = [self.history[i][self.rows.valid[i]].tolist() for i in range(self.n_rows)]
        r, t = tokens.shape
        out = torch.zeros(r, t, self.vocab_size)
        with Timer(self.stats, self.device, r * t):
            self.history = torch.cat([self.history, tokens], 1)
            self.rows.append(torch.zeros_like(valid))
            for i in range(r):
                for j in range(t):
                    if valid[i, j]:
                        path = tokens[i][anc[i, j]].tolist()  # ancestors in index order = root first
                        out[i, j] = self.next_logits(prefixes[i] + path)
        return out

    def _keep_nodes(self, keep: torch.Tensor) -> None:
        """``TreeOps`` hook: the kept nodes become the row's next real positions, in order."""
        r, t = keep.shape
        if t > self.rows.length or bool(self.rows.valid[:, self.rows.length - t :].any()):
            raise ValueError("keep_path() must directly follow extend_tree() with the same tree width")
        n = keep.sum(1)
        start = self.rows.length - t
        tail = self.history[:, start:].gather(1, kept_first(keep))
        self.history = torch.cat([self.history[:, :start], tail], 1)
        kept_cols = torch.arange(t)[None, :] < n[:, None]
        self.rows.replace_tail(start, kept_cols)
        self.drop_tail(torch.zeros(r, dtype=torch.long))  # dropping nothing lets the backend compact holes

    def _forward(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        if int(self.rows.n_real.max()) + ids.shape[1] > self.max_length:
            raise ValueError(f"sequence would exceed the context of {self.max_length} tokens")
        self.history = torch.cat([self.history, ids], 1)
        self.rows.append(valid)
        r, t = ids.shape
        with Timer(self.stats, self.device, r * t):
            out = self._logits_of_last(t)
        self.nonfinite = self.nonfinite | torch.isnan(out).any()  # read by ``check_finite``, not now
        return out

    def _logits_of_last(self, t: int) -> torch.Tensor:
        """Logits after each of the last ``t`` physical positions, vectorized over rows."""
        valid = self.rows.valid
        r, n = valid.shape
        # compact every row's real tokens to the left, then read the last `order` of each prefix
        count = torch.cumsum(valid.long(), 1)  # [R, L] real tokens up to each position
        compact = torch.zeros(r, n + 1, dtype=torch.long)
        compact.scatter_(1, torch.where(valid, count - 1, n), self.history)
        seen = count[:, n - t :]  # [R, T]
        idx = seen[:, :, None] - self.order + torch.arange(self.order)  # [R, T, order]
        ctx = torch.where(idx >= 0, compact.gather(1, idx.clamp(min=0).view(r, -1)).view(idx.shape), 0)
        return self.table[tuple(ctx.unbind(-1))] if self.order else self.table.expand(r, t, -1)


def _no_hidden(lm: MockLM, hidden: object) -> None:
    if hidden is not None:
        raise ValueError(f"{lm.name}: this model takes no hidden states")

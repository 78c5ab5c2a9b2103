"""The row store: every row of a draft and a target backend, and the only code that moves them.

A row is one context of one particle (or one request, for the speculative baselines). The
store prefills, forks, forwards, commits and drops rows; it knows nothing of weights,
temperatures or schedules. Besides the backends' KV caches it keeps, per row, the tokens each
model has not read yet (the deferred bonus for the target; for the draft also the kept tokens
it did not feed), and, while the target has read everything, its logits for the next token.

A feature draft (``models.feature_draft.FeatureDraft``) reads, with each token, the
target's hidden state at the position before it. Inside a block it feeds back its own
predicted states; at ``commit`` those speculative positions are dropped and the kept
tokens are queued again with the target's true states from the fused forward, which
``score`` returned to the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backends.base import BatchedLM, NonFiniteLogits, check_finite, pad_left, pad_left_hidden, to_device


class RowStore:
    """The rows of a draft and a target backend that share a vocabulary and a device."""

    def __init__(self, target: BatchedLM, draft: BatchedLM) -> None:
        if target.vocab_size != draft.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size}); "
                "SMC-SD needs a draft that shares the target's tokenizer"
            )
        devices = {str(getattr(lm, "device", "cpu")) for lm in (target, draft)}
        if len(devices) > 1:
            raise ValueError(f"draft and target are on different devices {sorted(devices)}: use one device")
        self.target, self.draft = target, draft
        self.device = getattr(target, "device", torch.device("cpu"))
        # Whether reading the device is free (a CPU): drafting may then stop once every row has
        # ended, and verification read only each row's own positions. On an accelerator each
        # would be a sync (tests turn it off to count the latter's reads).
        self.free_reads = self.device.type == "cpu"
        self.reads_hidden = bool(getattr(draft, "reads_hidden", False))
        if self.reads_hidden:
            if not hasattr(target, "keep_hidden_states"):
                raise ValueError("a feature draft needs a target backend that returns hidden states")
            target.keep_hidden_states()
        self.draft_ready = False  # the draft holds the rows (``start`` may leave it out)
        self.target_pending: list[list[int]] = []
        self.draft_pending: list[list[int]] = []
        self.draft_hidden: list[torch.Tensor] = []  # per row: target states paired with draft_pending
        # Per row, while ``target_pending`` is empty: the target's untempered logits for the next
        # token [V] and (feature drafts) its state at the last position [H]; None otherwise.
        self.known: list[torch.Tensor | None] = []
        self.known_hidden: list[torch.Tensor | None] = []
        self.scored: dict[int, int] = {}  # drafted tokens the last score fed the target, per row

    @property
    def n_rows(self) -> int:
        """Rows held."""
        return len(self.target_pending)

    @torch.inference_mode()
    def start(
        self, prompts: Sequence[Sequence[int]], rows: Sequence[int], *, draft: bool = True
    ) -> torch.Tensor:
        """Prefill both models with ``prompts``; row r then holds prompt ``rows[r]``.

        Returns each row's next-token target logits ``[R, V]`` (untempered), which the store
        also keeps until a token is queued. ``draft=False`` leaves the draft out, for runs whose
        rows all decode with the target alone.
        """
        logits = self.target.prefill(prompts)  # [B, V]
        self.draft_ready = draft
        last = None
        if self.reads_hidden:  # token j of a prompt goes with the target's state at j-1
            h = self.target.hidden  # [B, W, H], left-padded
            last = h[:, -1]
            if draft:
                zero, w = h.new_zeros(1, h.shape[-1]), h.shape[1]
                states = [torch.cat([zero, h[i, w - len(p) : w - 1]]) for i, p in enumerate(prompts)]
                self.draft.prefill(prompts, states)
        elif draft:
            self.draft.prefill(prompts)
        index = torch.tensor(list(rows))  # on the host: the backends fork without reading it back
        self.target.fork(index)
        if draft:
            self.draft.fork(index)
        n = len(index)
        self.target_pending, self.draft_pending = [[] for _ in range(n)], [[] for _ in range(n)]
        self.draft_hidden = [last.new_zeros(0, last.shape[-1]) for _ in range(n)] if last is not None else []
        logits = logits.index_select(0, index.to(logits.device))
        self.known = list(logits)
        self.known_hidden = (
            list(last.index_select(0, index.to(last.device))) if last is not None else [None] * n
        )
        return logits

    @torch.inference_mode()
    def append(self, prompts: Sequence[Sequence[int]], rows: Sequence[int]) -> torch.Tensor:
        """Add rows after those held, prefilled alone: new row i holds prompt ``rows[i]``.

        The rows held keep their state (requests joining a running batch). Returns the new
        rows' next-token target logits ``[len(rows), V]`` (untempered), which the store keeps.
        """
        if self.reads_hidden:
            raise ValueError(
                "a feature draft cannot take requests joining a running batch: use a token draft"
            )
        held = self.n_rows
        logits = self.target.append(prompts)
        if self.draft_ready:
            self.draft.append(prompts)
        index = torch.tensor([*range(held), *(held + r for r in rows)])
        self.target.fork(index)
        if self.draft_ready:
            self.draft.fork(index)
        logits = logits.index_select(0, torch.tensor(list(rows), device=logits.device))
        self.target_pending += [[] for _ in rows]
        self.draft_pending += [[] for _ in rows]
        self.known += list(logits)
        self.known_hidden += [None] * len(rows)
        return logits

    def queue(self, tokens: dict[int, Sequence[int]]) -> None:
        """Queue ``tokens[row]`` for both models to read with their next forwards.

        A feature draft reads each token with the target's state before it, which the store
        has only for the first token after a position the target has read.
        """
        for r, new in tokens.items():
            if not new:
                continue
            if self.reads_hidden and self.draft_ready:
                if len(new) > 1 or self.known_hidden[r] is None:
                    raise ValueError(
                        "token-level steps need a token draft: this draft reads the target's hidden states"
                    )
                self.draft_hidden[r] = torch.cat([self.draft_hidden[r], self.known_hidden[r][None]])
            self.target_pending[r] = self.target_pending[r] + [int(t) for t in new]
            if self.draft_ready:
                self.draft_pending[r] = self.draft_pending[r] + [int(t) for t in new]
            self.known[r] = self.known_hidden[r] = None

    @torch.inference_mode()
    def next_logits(self, rows: Sequence[int]) -> torch.Tensor:
        """The target's untempered logits for the next token of each row ``[n, V]``.

        Rows with queued tokens are read in ONE target forward (every other row a hole); the
        draft reads them later, with its next forward.
        """
        todo = [r for r in rows if self.known[r] is None]
        if todo:
            if self.reads_hidden and self.draft_ready:
                raise ValueError(
                    "token-level steps need a token draft: this draft reads the target's hidden states"
                )
            asked = set(todo)
            ids, valid = pad_left(
                [p if r in asked else [] for r, p in enumerate(self.target_pending)], self.device
            )
            logits = self.target.extend(ids, valid)[:, -1]  # [R, V]
            for r in todo:
                self.known[r], self.target_pending[r] = logits[r], []
        return torch.stack([self.known[r] for r in rows])

    @torch.inference_mode()
    def next_logits_and_trees(
        self, rows: Sequence[int], trees: Sequence[tuple[list[int], list[int]]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``next_logits(rows)``, and the logits of a token tree read after each row, in ONE forward.

        ``trees[i]`` is (tokens, parents) after row ``rows[i]``'s queued tokens (parent -1: the
        row's end). The queued tokens are read as the tree's trunk and kept; the tree is
        forgotten. Returns the next-token logits ``[n, V]`` and each tree's ``[nodes, V]``.
        """
        if self.reads_hidden and self.draft_ready:
            raise ValueError(
                "token-level steps need a token draft: this draft reads the target's hidden states"
            )
        trunks = [self.target_pending[r] if self.known[r] is None else [] for r in rows]
        width = max(len(t) + len(tree[0]) for t, tree in zip(trunks, trees))
        tokens = torch.zeros(self.n_rows, width, dtype=torch.long)
        parents = torch.full((self.n_rows, width), -1, dtype=torch.long)
        valid = torch.zeros(self.n_rows, width, dtype=torch.bool)
        for r, trunk, (nodes, ups) in zip(rows, trunks, trees):
            n = len(trunk)
            tokens[r, : n + len(nodes)] = torch.tensor(trunk + list(nodes), dtype=torch.long)
            # the trunk is a chain; the tree hangs from its last token (the row's end, -1 without one)
            parents[r, :n] = torch.arange(n) - 1
            parents[r, n : n + len(nodes)] = torch.tensor(
                [n - 1 if u < 0 else n + u for u in ups], dtype=torch.long
            )
            valid[r, : n + len(nodes)] = True
        logits = self.target.extend_tree(tokens, parents, valid)  # [R, width, V]
        keep = torch.zeros_like(valid)
        for r, trunk in zip(rows, trunks):
            keep[r, : len(trunk)] = True
        self.target.keep_path(keep)
        out = []
        for r, trunk, (nodes, _) in zip(rows, trunks, trees):
            if trunk:
                self.known[r], self.target_pending[r] = logits[r, len(trunk) - 1], []
            out.append(logits[r, len(trunk) : len(trunk) + len(nodes)])
        return torch.stack([self.known[r] for r in rows]), out

    def draft_input(self, asked: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The draft's next input: the queued tokens of the ``asked`` rows, holes elsewhere.

        Returns ``ids [R, T]``, ``valid [R, T]`` and a feature draft's states ``[R, T, H]``.
        """
        ids, valid = pad_left([p if a else [] for p, a in zip(self.draft_pending, asked)], self.device)
        if not self.reads_hidden:
            return ids, valid, None
        queued = [f if a else f[:0] for f, a in zip(self.draft_hidden, asked)]
        return ids, valid, pad_left_hidden(queued, ids.shape[1]).to(self.device)

    def draft_read(self, rows: Sequence[int]) -> None:
        """A draft forward has read the queued tokens of ``rows``."""
        for r in rows:
            self.draft_pending[r] = []
            if self.reads_hidden:
                self.draft_hidden[r] = self.draft_hidden[r][:0]

    @torch.inference_mode()
    def score(
        self, rows: Sequence[int], blocks: torch.Tensor, read: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ONE target forward over [pending, d_1..d_k] of ``rows`` (every other row a hole).

        ``blocks [n, k]``: the rows' drafted tokens, wherever they are (the feed takes them on the
        device, without reading them). Returns the untempered logits ``[n, k+1, V]`` of the asked
        rows, in order (position j scores d_{j+1}; position k is the bonus position), and for a
        feature draft the target's states at the same positions ``[n, k+1, H]``, which ``commit``
        takes back. ``read[i]``: the drafted tokens row i's verification can reach: only those are
        fed, and its positions past ``read[i]`` are 0 (a batch's blocks share one length k).
        """
        k = blocks.shape[1]
        if read is None or self.reads_hidden:
            read = [k] * len(rows)
        self.scored = dict(zip(rows, read))
        ids, valid = self._feed(rows, blocks, read)
        if min(read, default=k) < k:
            return _windows(self.target.extend(ids, valid), rows, read, k), None
        logits = self.target.extend(ids, valid)[:, -(k + 1) :]
        hidden = self.target.hidden[:, -(k + 1) :] if self.reads_hidden else None
        if list(rows) != list(range(self.n_rows)):  # usually every row asks: skip the copy
            index = torch.tensor(list(rows), device=self.device)
            logits = logits.index_select(0, index)
            hidden = hidden.index_select(0, index) if hidden is not None else None
        return logits, hidden

    def _feed(
        self, rows: Sequence[int], blocks: torch.Tensor, read: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The left-padded feed ``[R, W]`` of each asked row's queued tokens and first ``read`` drafted ones.

        The queued tokens and the layout are the host's; the drafted tokens are gathered into
        their places where they are, so the host never waits for them.
        """
        k = blocks.shape[1]
        asked = dict(zip(rows, range(len(rows))))
        feed = [
            self.target_pending[r] + [0] * read[i] if (i := asked.get(r)) is not None else []
            for r in range(self.n_rows)
        ]
        ids, valid = pad_left(feed)
        take = torch.full(ids.shape, -1, dtype=torch.long)  # where a drafted token goes: its index in blocks
        width = ids.shape[1]
        for r, i in asked.items():
            n = read[i]
            take[r, width - n :] = i * k + torch.arange(n)
        ids, take = to_device(ids, self.device), to_device(take, self.device)
        drafted = blocks.to(self.device).reshape(-1)
        if drafted.numel():
            ids = torch.where(take >= 0, drafted[take.clamp(min=0)], ids)
        return ids, to_device(valid, self.device)

    def commit(
        self,
        rows: Sequence[int],
        blocks: Sequence[Sequence[int]],
        kept: Sequence[int],
        nexts: Sequence[int | None],
        fed: Sequence[int],
        hidden: torch.Tensor | None = None,
    ) -> None:
        """Keep ``kept[i]`` tokens of each block, queue the next token, hole out the rest.

        After ``score`` the target holds [pending, d_1..d_k] and the draft [pending,
        d_1..d_fed] (``fed[i]``: the drafted tokens it read); both then await ``nexts[i]``
        (the deferred bonus), the draft also the kept tokens it has not read. A row without a
        next token stops and leaves at the next ``fork``. A feature draft drops all its
        drafted positions (computed from predicted states) and queues the kept tokens again
        with the target's states ``hidden`` from ``score``.
        """
        k = len(blocks[0]) if blocks else 0
        drop_t, drop_d = {}, {}
        with_states = self.reads_hidden and self.draft_ready
        for i, (r, block, n, nxt, f) in enumerate(zip(rows, blocks, kept, nexts, fed)):
            tail = [] if nxt is None else [nxt]
            self.target_pending[r], self.known[r], self.known_hidden[r] = tail, None, None
            if with_states:
                self.draft_pending[r] = list(block[:n]) + tail if tail else []
                self.draft_hidden[r] = hidden[i][: n + 1] if tail else hidden[i][:0]
            elif self.draft_ready:  # else decoding alone: the draft has nothing to keep in step
                self.draft_pending[r] = self.draft_pending[r] + list(block[f:n]) + tail
            if nxt is not None:
                drop_t[r] = self.scored.get(r, k) - n
                # A feature draft read its fed tokens with predicted states: all are dropped.
                drop_d[r] = f if with_states else max(0, f - n)
        self._drop(self.target, drop_t)
        self._drop(self.draft, drop_d)

    def _drop(self, backend: BatchedLM, n_by_row: dict[int, int]) -> None:
        if any(n_by_row.values()):
            n = torch.zeros(self.n_rows, dtype=torch.long)
            for r, d in n_by_row.items():
                n[r] = d
            backend.drop_tail(n)

    def fork(self, rows: Sequence[int]) -> None:
        """Keep ``rows`` in this order (live particles, resampled ancestors repeated)."""
        rows = list(rows)
        if rows == list(range(self.n_rows)):
            return
        if rows:
            index = torch.tensor(rows)  # on the host: backends then know the rows without a read
            self.target.fork(index)
            if self.draft_ready:
                self.draft.fork(index)
        self.target_pending = [list(self.target_pending[r]) for r in rows]
        self.draft_pending = [list(self.draft_pending[r]) for r in rows]
        self.known = [self.known[r] for r in rows]
        self.known_hidden = [self.known_hidden[r] for r in rows]
        if self.reads_hidden and self.draft_hidden:
            self.draft_hidden = [self.draft_hidden[r] for r in rows]

    def release(self) -> bool:
        """Drop every row of both models and free what they hold, where both backends can.

        Returns whether it did. The next ``start`` prefills afresh, as it always does.
        """
        backends = (self.target, self.draft)  # a fork to no rows empties only the store's lists
        if not any(lm.n_rows for lm in backends) or not all(hasattr(lm, "release") for lm in backends):
            return False
        for lm in backends:
            lm.release()
        self.draft_ready = False
        self.target_pending, self.draft_pending, self.draft_hidden = [], [], []
        self.known, self.known_hidden = [], []
        return True

    def check_finite(self) -> None:
        """Raise if either backend produced NaN logits since the last check (one host read)."""
        check_finite(self.target, self.draft)

    def nonfinite(self) -> str:
        """Which models produced NaN logits since the last check ("" for none), the check reset."""
        named = []
        for lm in (self.target, self.draft):
            try:
                lm.check_finite()
            except NonFiniteLogits:
                named.append(lm.name)
        return " and ".join(named)


def _windows(logits: torch.Tensor, rows: Sequence[int], read: Sequence[int], k: int) -> torch.Tensor:
    """Each asked row's last ``read + 1`` positions (a left-padded feed), at the start of its ``k + 1``."""
    n = torch.tensor(list(read))
    j = torch.arange(k + 1)
    i, jj = (j[None, :] <= n[:, None]).nonzero(as_tuple=True)  # the positions verification reads
    src = torch.tensor(list(rows))[i], logits.shape[1] - n[i] - 1 + jj
    out = logits.new_zeros(len(rows), k + 1, logits.shape[-1])
    out[i.to(out.device), jj.to(out.device)] = logits[src[0].to(out.device), src[1].to(out.device)]
    return out

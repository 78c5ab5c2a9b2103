"""The ``BatchedLM`` contract as a reusable check, shipped with the library.

Every logit a backend returns must equal the logit of its row's real tokens fed
alone: however the tokens came (one fused forward or one at a time), whatever holes
sit among them (left padding, masked positions, dropped tails), and after any fork.
``BatchedLMContract`` drives a backend through those operations and compares each
logit with a recomputation: by default a fresh backend prefilled with the row alone,
or any ``reference`` given (a plain forward of the model, an exact table). A backend
with tree operations (``TreeLM``) has its trees checked too. Run it in a test::

    BatchedLMContract(lambda: HFBatchedLM(model)).check_all()

A broken backend raises ``ContractError`` naming the check, the row and the position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .base import BatchedLM, TreeLM

PROMPT_LENGTHS = (5, 2, 4, 1)  # unequal, so prefill pads; one single token
HOLES = ((1, 0, 1, 1), (0, 1, 0, 1), (1, 1, 1, 1), (0, 0, 1, 1))  # valid masks of a 4-token block
TREE_PARENTS = ((-1, 0, 0, 1, 3), (-1, 0, 1, 1, 0), (-1, -1, 0, 1, 2), (-1, 0, 1, 2, 3))
TREE_VALID = ((1, 1, 1, 1, 1), (1, 1, 1, 1, 0), (1, 1, 1, 1, 1), (1, 1, 1, 0, 0))
TREE_KEEP = ((1, 1, 0, 1, 0), (1, 0, 0, 0, 0), (0, 1, 0, 1, 0), (1, 1, 1, 0, 0))


class ContractError(AssertionError):
    """A backend (or a constraint) broke its contract; the message names the check."""


class BatchedLMContract:
    """Checks a ``BatchedLM`` against recomputation from scratch.

    Args:
        factory: makes a fresh backend over the same model (called several times).
        reference: logits ``[V]`` after a token sequence; default: a fresh backend's prefill.
        atol: absolute logit tolerance (float32: 1e-4; an exact backend: 0).
        rtol: relative logit tolerance.
        seed: seeds the prompts and tokens drawn.
        vocab: token ids to draw from (default: every id of the backend's vocabulary).
    """

    CHECKS = (
        "fused_equals_stepwise",
        "padding_invisible",
        "holes_invisible",
        "fork_equals_recompute",
        "drop_tail_equals_recompute",
        "vocab_subset",
        "append_keeps_rows",
        "tree",
    )

    def __init__(
        self,
        factory: Callable[[], BatchedLM],
        *,
        reference: Callable[[Sequence[int]], torch.Tensor] | None = None,
        atol: float = 1e-4,
        rtol: float = 1e-4,
        seed: int = 0,
        vocab: Sequence[int] | None = None,
    ) -> None:
        self.factory, self.atol, self.rtol = factory, atol, rtol
        self.reference = reference or (lambda seq: self.factory().prefill([list(seq)])[0])
        self.g = torch.Generator().manual_seed(seed)
        self.vocab = torch.as_tensor(vocab if vocab is not None else range(factory().vocab_size))

    def check_all(self) -> None:
        """Run every check; the first broken one raises ``ContractError``."""
        for name in self.CHECKS:
            getattr(self, f"check_{name}")()

    def check_fused_equals_stepwise(self) -> None:
        """ONE forward over a block gives the logits of feeding it token by token, and of recomputing."""
        prompts, block = self._prompts(), self._tokens(len(PROMPT_LENGTHS), 4)
        fused_lm, stepwise_lm = self._started(prompts), self._started(prompts)
        calls = fused_lm.stats.calls
        fused = fused_lm.extend(block)
        if fused_lm.stats.calls != calls + 1:
            raise ContractError(
                f"fused_equals_stepwise: one extend counted {fused_lm.stats.calls - calls} forwards"
            )
        if tuple(fused.shape) != (len(prompts), 4, fused_lm.vocab_size) or fused.dtype != torch.float32:
            raise ContractError(f"fused_equals_stepwise: logits {tuple(fused.shape)} {fused.dtype}")
        steps = torch.stack([stepwise_lm.extend(block[:, j : j + 1])[:, 0] for j in range(4)], 1)
        for i, p in enumerate(prompts):
            for j in range(4):
                what = f"fused_equals_stepwise: row {i} position {j}"
                self._same(fused[i, j], steps[i, j], what)
                self._same(fused[i, j], self.reference(p + block[i, : j + 1].tolist()), what)

    def check_padding_invisible(self) -> None:
        """Left-padded prompts give the logits of each prompt fed alone."""
        prompts = self._prompts()
        first = self.factory().prefill(prompts)
        for i, p in enumerate(prompts):
            self._same(first[i], self.reference(p), f"padding_invisible: row {i}")

    def check_holes_invisible(self) -> None:
        """Holes in a block are invisible to the block's real tokens and to later ones."""
        prompts = self._prompts()
        lm = self._started(prompts)
        block, valid = self._tokens(len(prompts), 4), torch.tensor(HOLES, dtype=torch.bool)
        out = lm.extend(block, valid)
        seqs = []
        for i, p in enumerate(prompts):
            seq = list(p)
            for j in range(4):
                if valid[i, j]:
                    seq.append(int(block[i, j]))
                    self._same(out[i, j], self.reference(seq), f"holes_invisible: row {i} position {j}")
            seqs.append(seq)
        self._extend_and_compare(lm, seqs, 2, "holes_invisible (after the holes)")

    def check_fork_equals_recompute(self) -> None:
        """Forks that repeat, reorder, drop and add rows keep each row's logits."""
        prompts = self._prompts()
        lm = self._started(prompts)
        seqs = self._extend_and_compare(lm, [list(p) for p in prompts], 3, "fork_equals_recompute")
        for rows in ([2, 0, 0, 1], [3, 1], [0, 1, 1, 0, 1, 0]):
            lm.fork(torch.tensor(rows))
            seqs = [list(seqs[r]) for r in rows]
            seqs = self._extend_and_compare(lm, seqs, 2, f"fork_equals_recompute (rows {rows})")

    def check_drop_tail_equals_recompute(self) -> None:
        """Dropped tails are forgotten: later logits see only the tokens kept."""
        prompts = self._prompts()
        lm = self._started(prompts)
        seqs = [list(p) for p in prompts]
        for drop in ([0, 2, 4, 1], [3, 0, 1, 4], [4, 4, 0, 2]):
            block = self._tokens(len(seqs), 4)
            lm.extend(block)
            lm.drop_tail(torch.tensor(drop))
            seqs = [s + block[i, : 4 - d].tolist() for i, (s, d) in enumerate(zip(seqs, drop))]
            seqs = self._extend_and_compare(lm, seqs, 2, f"drop_tail_equals_recompute (dropped {drop})")

    def check_vocab_subset(self) -> None:
        """``extend(vocab=U)`` returns the full logits' columns ``U``."""
        prompts = self._prompts()
        lm = self._started(prompts)
        block = self._tokens(len(prompts), 3)
        full = lm.extend(block)
        lm.drop_tail(torch.full((len(prompts),), 3))
        vocab = self.vocab[torch.randperm(len(self.vocab), generator=self.g)[:4]].sort().values
        part = lm.extend(block, vocab=vocab)
        if tuple(part.shape) != (len(prompts), 3, len(vocab)):
            raise ContractError(
                f"vocab_subset: logits {tuple(part.shape)}, want {(len(prompts), 3, len(vocab))}"
            )
        self._same(part, full[..., vocab.to(full.device)], "vocab_subset")

    def check_append_keeps_rows(self) -> None:
        """Rows appended to running ones get their prompts' logits; every row keeps its own after."""
        prompts = self._prompts()
        lm = self._started(prompts)
        block = self._tokens(len(prompts), 3)
        lm.extend(block)
        lm.drop_tail(torch.tensor([0, 2, 1, 3]))  # running rows of different lengths
        seqs = [p + block[i, : 3 - d].tolist() for i, (p, d) in enumerate(zip(prompts, (0, 2, 1, 3)))]
        joining = [self._tokens(1, n)[0].tolist() for n in (9, 1)]  # longer than any row, and one token
        first = lm.append(joining)
        if tuple(first.shape) != (2, lm.vocab_size) or lm.n_rows != len(seqs) + 2:
            raise ContractError(f"append_keeps_rows: logits {tuple(first.shape)}, {lm.n_rows} rows")
        for i, p in enumerate(joining):
            self._same(first[i], self.reference(p), f"append_keeps_rows: joining row {i}")
        seqs = self._extend_and_compare(lm, seqs + joining, 2, "append_keeps_rows (after the append)")
        rows = [5, 0, 4, 5, 2]
        lm.fork(torch.tensor(rows))
        self._extend_and_compare(lm, [seqs[r] for r in rows], 1, f"append_keeps_rows (rows {rows})")

    def check_tree(self) -> None:
        """Tree nodes get their root-to-node path's logits; ``keep_path`` keeps that path."""
        lm = self.factory()
        if not isinstance(lm, TreeLM):
            return
        prompts = self._prompts()
        lm.prefill(prompts)
        block = self._tokens(len(prompts), 2)
        lm.extend(block)
        lm.drop_tail(torch.tensor([0, 1, 2, 0]))  # rows of different lengths, holes behind some
        seqs = [p + block[i, : 2 - d].tolist() for i, (p, d) in enumerate(zip(prompts, (0, 1, 2, 0)))]
        parents, valid = torch.tensor(TREE_PARENTS), torch.tensor(TREE_VALID, dtype=torch.bool)
        tokens = self._tokens(*parents.shape)
        logits = lm.extend_tree(tokens, parents, valid)
        for i, seq in enumerate(seqs):
            for j in range(parents.shape[1]):
                if valid[i, j]:
                    path = _path(tokens[i].tolist(), parents[i].tolist(), j)
                    self._same(logits[i, j], self.reference(seq + path), f"tree: row {i} node {j}")
        keep = torch.tensor(TREE_KEEP, dtype=torch.bool)
        lm.keep_path(keep)
        seqs = [s + tokens[i][keep[i]].tolist() for i, s in enumerate(seqs)]
        self._extend_and_compare(lm, seqs, 2, "tree (after keep_path)")

    def _prompts(self) -> list[list[int]]:
        return [self._tokens(1, n)[0].tolist() for n in PROMPT_LENGTHS]

    def _tokens(self, rows: int, n: int) -> torch.Tensor:
        """Random token ids ``[rows, n]`` from the vocabulary drawn from."""
        return self.vocab[torch.randint(len(self.vocab), (rows, n), generator=self.g)]

    def _started(self, prompts: list[list[int]]) -> BatchedLM:
        lm = self.factory()
        lm.prefill(prompts)
        return lm

    def _extend_and_compare(self, lm: BatchedLM, seqs: list[list[int]], n: int, what: str) -> list[list[int]]:
        """Extend every row by ``n`` tokens; each logit must equal the recomputed one."""
        block = self._tokens(len(seqs), n)
        out = lm.extend(block)
        grown = []
        for i, seq in enumerate(seqs):
            seq = list(seq)
            for j in range(n):
                seq.append(int(block[i, j]))
                self._same(out[i, j], self.reference(seq), f"{what}: row {i} position {j}")
            grown.append(seq)
        return grown

    def _same(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        got, want = got.detach().float().cpu(), want.detach().float().cpu()
        if got.shape != want.shape:
            raise ContractError(f"{what}: logits {tuple(got.shape)}, recomputed {tuple(want.shape)}")
        if not torch.allclose(got, want, atol=self.atol, rtol=self.rtol):
            gap = float((got - want).abs().max())
            raise ContractError(f"{what}: logits differ from the recomputation by up to {gap:.3g}")


def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from the root to ``node``, root first."""
    path = []
    while node >= 0:
        path.insert(0, tokens[node])
        node = parents[node]
    return path

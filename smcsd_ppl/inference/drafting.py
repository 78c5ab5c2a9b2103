"""One batched drafting call: the draft's next input, the tokens drawn, the rows that ended.

``BlockEngine.draft_blocks`` feeds the rows' queued tokens, then draws a block position
by position with ``Drafting.step``: a draft step (one forward, q sampled) or, where a
constraint leaves every drafting row one allowed token, a forced step (no forward; the
token is fed with the next one). It then cuts each row's block from ``Drafting.drawn``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends.base import BatchedLM
from ..spec import sample_probs
from . import constrained


@dataclass
class Drafting:
    """The state of one ``draft_blocks`` call over all backend rows.

    Attributes:
        draft: the draft backend, holding every row.
        g: the run's generator, which draws the tokens.
        rows: backend row of each request.
        masking: the proposal-mode constraints of the requests.
        ids, valid: the draft's next input ``[R, T]``, holes where ``valid`` is False.
        hidden: a feature draft's input states ``[R, T, H]`` (None for a token draft).
        asked: ``[R]`` rows that draft (the others are fed holes).
        budget: ``[R]`` tokens each row may still draft in this block.
        eos: the end-of-sequence token ids.
        longest: the most tokens any row may draft: drafting stops there.
        host_checks: whether each step may read the device to stop once every row has ended.
        temperature: the draft temperature T_d.
        keep_probs: whether to keep q over the whole vocabulary at each position.
    """

    draft: BatchedLM
    g: torch.Generator
    rows: list[int]
    masking: constrained.Masking
    ids: torch.Tensor
    valid: torch.Tensor
    hidden: torch.Tensor | None
    asked: torch.Tensor
    budget: torch.Tensor
    eos: torch.Tensor
    longest: int
    host_checks: bool
    temperature: float
    keep_probs: bool
    drafts: list[torch.Tensor] = field(default_factory=list)  # [R] token per drawn position
    logqs: list[torch.Tensor] = field(default_factory=list)  # [R] log q of each
    probs: list[torch.Tensor] = field(default_factory=list)  # [R, V] q at each, if kept
    fed: int = 0  # drafted tokens the draft has read: it holds [pending, d_1..d_fed]
    pending_fed: bool = False  # a forward has read the rows' queued tokens

    def __post_init__(self) -> None:
        self.ended = ~self.asked
        self.reads_hidden = self.hidden is not None
        self.device = self.asked.device
        self.n_rows = len(self.asked)

    def step(self, j: int) -> None:
        """Draw position ``j`` of every row's block: forced where constraints leave one token."""
        allowed = self.masking.next_masks(self.drafts)  # proposal-mode rows sample allowed tokens only
        self._end_dead_rows()
        masks = constrained.live_masks(allowed, self.rows, self.ended)  # None: some row samples freely
        # A feature draft never skips: its next input is the state this forward predicts.
        d = None if masks is None or self.reads_hidden else constrained.forced_tokens(masks, self.n_rows)
        d, q = self._forced_step(d.to(self.device)) if d is not None else self._draft_step(masks, allowed)
        self.drafts.append(d)
        if self.keep_probs:
            self.probs.append(q)
        self.ended |= torch.isin(d, self.eos) | (self.budget <= j + 1)
        self._end_dead_rows()

    def finished(self, j: int) -> bool:
        """Whether drafting stops after position ``j``: no later token could count."""
        return j + 1 >= self.longest or (self.host_checks and bool(self.ended.all()))

    def drawn(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Tokens ``[R, k]`` and their log q ``[R, k]`` on the host, q ``[R, k, V]`` if kept."""
        tokens = torch.stack(self.drafts, 1).cpu()
        logq = torch.stack(self.logqs, 1).cpu()
        return tokens, logq, torch.stack(self.probs, 1) if self.probs else None

    def _end_dead_rows(self) -> None:
        if self.masking.dead_at:
            self.ended[[self.rows[i] for i in self.masking.dead_at]] = True

    def _forced_step(self, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every drafting row has one allowed token ``d``: q is a point mass, no forward runs."""
        q = torch.nn.functional.one_hot(d, self.draft.vocab_size).float() if self.keep_probs else None
        self.logqs.append(torch.zeros(self.n_rows, device=self.device))
        self.ids, self.valid = (
            torch.cat([self.ids, d[:, None]], 1),
            torch.cat([self.valid, self.asked[:, None]], 1),
        )
        return d, q

    def _draft_step(
        self, masks: dict[int, torch.Tensor] | None, allowed: dict[int, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over the pending input, then a token from q (masked where constrained)."""
        vocab_size = self.draft.vocab_size
        extra = (self.hidden,) if self.reads_hidden else ()
        vocab = None if masks is None else constrained.shared_vocab(masks, vocab_size)
        kw = {} if vocab is None else {"vocab": vocab}  # logits of allowed tokens only
        logits = self.draft.extend(self.ids, self.valid, *extra, **kw)
        self.fed, self.pending_fed = len(self.drafts), True
        q = torch.softmax(logits[:, -1].div_(self.temperature), -1)  # [R, V], or [R, U] over vocab
        if vocab is not None:
            q = q.new_zeros(len(q), vocab_size).index_copy_(1, vocab.to(q.device), q)
        self.masking.restrict(q, allowed)
        d = sample_probs(q, self.g)
        self.logqs.append(q.gather(-1, d[:, None])[:, 0].log())
        self.ids, self.valid = d[:, None], self.asked[:, None]
        if self.reads_hidden:  # the draft's own predicted state goes with its next token
            self.hidden = self.draft.hidden[:, -1:]
        return d, q

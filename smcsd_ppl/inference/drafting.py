"""One batched drafting call: the draft's input, the tokens drawn, where each row's block ends.

``draft_blocks`` feeds the rows' queued tokens from the row store, then draws a block
position by position with ``Drafting.step``: a draft step (one forward, q sampled) or,
where a constraint leaves every drafting row one allowed token, a forced step (no
forward; the token is fed with the next one). A row decoding with the target alone drafts
its constraint's forced tokens and nothing else: they cost no forward of either model, and
the target reads them with the row's queued tokens. It then ends each row's block at its
first EOS, its budget, its draft length, or where its constraint ends it.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

import torch

from ..backends.base import BatchedLM, to_device
from ..proposals.blocks import Retrieval
from ..verification import drawn_log_probs, inverse_cdf
from ..verification.processing import RowSampling, processed
from . import constrained
from .blocks import BlockRequest, DraftBatch, DraftedBlock
from .rows import RowStore

Draws = Callable[[int], torch.Tensor]  # draft position j -> a uniform per backend row [R]


def generator_draws(g: torch.Generator, n_rows: int, device: torch.device) -> Draws:
    """Draws from one generator for the whole batch (the speculative baselines'), in position order."""
    return lambda j: torch.rand(n_rows, generator=g, device=device)


@torch.inference_mode()
def draft_blocks(
    store: RowStore,
    requests: Sequence[BlockRequest],
    *,
    block_size: int,
    temperature: float | torch.Tensor,
    eos: set[int],
    draws: Draws,
    keep_probs: bool = False,
    sampling: RowSampling | None = None,
) -> list[DraftedBlock]:
    """Up to ``block_size`` batched draft forwards over all rows; rows not asked for are fed holes.

    ``requests[i]`` asks for a block on row ``requests[i].row`` within its budget, under
    its constraint, from its proposal; its ``limit`` caps how many of its drafted tokens may
    count (0: the row does not draft); ``keep_probs`` also returns q over the whole vocabulary.
    ``temperature``: T_d, or one per backend row ``[R]``; ``draws(j)``: the uniforms ``[R]``
    position j is drawn with (see ``generator_draws``); ``sampling``: the rows whose requests
    process the target draft from q processed alike (where q spans the vocabulary). Drafting
    stops early once every asked row has ended (an EOS, its budget, a constraint's dead
    end): no later token could count, so all blocks of the call are that much shorter.
    On an accelerator, unconstrained drafting stops early on budgets only: spotting EOS
    tokens would cost a host sync per step (``store.free_reads``).
    Where a constraint leaves every drafting row one allowed token, q is a point mass
    whatever the draft says: that step skips its forward and the token is fed with the
    next one. Where every drafting row is constrained to a few tokens, the draft computes
    the logits of those tokens only. Retrieval rows run no draft forward and leave their
    queued tokens for the draft to read when it next drafts them.
    """
    sizes = [min(block_size, r.block_size or block_size) for r in requests]  # each request's own K
    limits = [k if r.limit is None or forces(r, store) else min(k, r.limit) for r, k in zip(requests, sizes)]
    if not any(limits):  # nobody drafts: the target alone decodes this cycle
        return _empty(store, requests, eos)
    settings = dict(block_size=block_size, temperature=temperature, eos=eos, draws=draws)
    run = _start(store, requests, limits, keep_probs=keep_probs, **settings)
    run.sampling = sampling
    for j in range(block_size):
        run.step(j)
        if run.finished(j):
            break
    if run.pending_fed:  # else the draft has read nothing yet: the pending tokens stay queued
        store.draft_read([r for r, a in enumerate(run.asked.tolist()) if a])
    blocks = _blocks(run, requests, limits, eos)
    if run.only_forcing and not any(b.limit for b in blocks):  # nothing was forced: the target alone
        return _empty(store, requests, eos, run.masking.history)
    return blocks


def forces(request: BlockRequest, store: RowStore) -> bool:
    """Whether a request decoding with the target alone drafts its constraint's forced tokens.

    Where a proposal-mode constraint allows one token, the target restricted to it is a
    point mass there: drawing that token without the target's logits is drawing from the
    proposal exactly, and the next forward reads the logits its weight needs. (A feature
    draft's rows keep the target's states of what they read: not done there.)
    """
    c = request.constraint
    alone = request.limit == 0 and request.proposal is None
    return alone and c is not None and c.mode == "proposal" and not store.reads_hidden


def _empty(store: RowStore, requests, eos, history: dict | None = None) -> list[DraftedBlock]:
    """Blocks of no tokens (the target alone), keeping any mask drafting computed for the bonus."""
    none = torch.zeros(store.n_rows, 0, dtype=torch.long, device=store.device)
    batch = DraftBatch(none, none.float())
    batch.known(range(store.n_rows), [[] for _ in range(store.n_rows)])
    blocks = [DraftedBlock(r.row, batch, 0, r.budget, r.constraint, eos=_eos(r, eos)) for r in requests]
    for i, b in enumerate(blocks):
        b.allowed = (history or {}).get(i, [])[:1]
    return blocks


def _eos(request: BlockRequest, eos: Container[int]) -> frozenset[int]:
    """The EOS ids that end a request's block (none where it ignores EOS)."""
    return frozenset(eos) if request.stops_at_eos else frozenset()


def _start(store: RowStore, requests, limits, *, block_size, temperature, eos, draws, keep_probs) -> Drafting:
    """The drafting state: each asked row's queued tokens are the first input."""
    rows = [r.row for r in requests]
    proposals = [r.proposal for r in requests]
    retrieval = None
    if any(p is not None and p.kind != "draft" for p in proposals):
        retrieval = Retrieval(proposals, rows, store.draft.vocab_size)
        keep_probs = keep_probs or bool(retrieval.requests("retrieval"))  # a refused token's residual reads r
    caps = [min(r.budget, n) for r, n in zip(requests, limits)]
    forcing = [forces(r, store) for r in requests]
    asked, retrieving = [False] * store.n_rows, [False] * store.n_rows
    for req, n, f in zip(requests, limits, forcing):
        p = req.proposal
        asked[req.row] = n > 0 and not f and (p is None or p.uses_draft)
        retrieving[req.row] = n > 0 and not f and not asked[req.row]
    ids, valid, hidden = store.draft_input(asked)
    budget = torch.full((store.n_rows,), block_size, device=store.device)
    budget[rows] = torch.tensor(caps, device=store.device)
    masking = constrained.Masking(rows, [r.constraint for r in requests], "proposal")
    stops = {r.row: r.stops_at_eos for r in requests}
    return Drafting(
        draft=store.draft,
        draws=draws,
        rows=rows,
        masking=masking,
        ids=ids,
        valid=valid,
        hidden=hidden,
        asked=torch.tensor(asked, device=store.device),
        retrieving=torch.tensor(retrieving, device=store.device),
        forcing={i for i, f in enumerate(forcing) if f},
        retrieval=retrieval,
        budget=budget,
        eos=torch.tensor(sorted(eos), dtype=torch.long, device=store.device),
        stops_at_eos=to_device(torch.tensor([stops.get(r, True) for r in range(store.n_rows)]), store.device),
        longest=max(caps),
        # Masks already bring every step to the host; on a CPU the check is free anyway.
        host_checks=store.free_reads or bool(masking.items),
        temperature=temperature.to(store.device)[:, None] if torch.is_tensor(temperature) else temperature,
        keep_probs=keep_probs,
    )


def _blocks(run: Drafting, requests, limits, eos) -> list[DraftedBlock]:
    """Each request's block over the call's drawn tokens (on the device: nothing is read here).

    Where a critic constraint must check the tokens, they are read (once for the call).
    """
    batch = DraftBatch(*run.drawn())
    critic = constrained.Masking(run.rows, [r.constraint for r in requests], "critic")
    critic_dead = critic.first_impossible(torch.tensor(batch.host())) if critic.items else {}
    dead_at = run.masking.dead_at | critic_dead  # request -> position
    ends = run.retrieval.ended_at if run.retrieval is not None else {}
    asked = run.asked.tolist()
    blocks = []
    for i, (req, n) in enumerate(zip(requests, limits)):
        r = req.row
        reach = min(n, run.masking.cut_at.get(i, n), ends.get(i, n))
        block = DraftedBlock(r, batch, reach, req.budget, req.constraint, dead_at.get(i), eos=_eos(req, eos))
        block.fed, block.allowed = (run.fed if asked[r] else 0), run.masking.history.get(i, [])
        block.drawn_at = tuple(run.drawn_at) if asked[r] else ()
        if run.retrieval is not None and run.retrieval.kinds.get(i) == "retrieval":
            checks = run.retrieval.checks.get(i, [])
            block.checks = checks + [1.0] * (batch.k - len(checks))
        blocks.append(block)
    return blocks


@dataclass
class Drafting:
    """The state of one ``draft_blocks`` call over all backend rows.

    Attributes:
        draft: the draft backend, holding every row.
        draws: the uniforms each position's tokens are drawn with.
        rows: backend row of each request.
        masking: the proposal-mode constraints of the requests.
        ids, valid: the draft's next input ``[R, T]``, holes where ``valid`` is False.
        hidden: a feature draft's input states ``[R, T, H]`` (None for a token draft).
        asked: ``[R]`` rows the draft model drafts (the others are fed holes).
        retrieving: ``[R]`` rows whose blocks retrieval draws (no draft forward).
        forcing: requests decoding with the target alone: they draft their forced tokens only.
        retrieval: the walks of the retrieval and mixture rows (None: none).
        budget: ``[R]`` tokens each row may still draft in this block.
        eos: the end-of-sequence token ids.
        stops_at_eos: ``[R]`` whether a row's request ends at EOS (not ``ignore_eos``).
        longest: the most tokens any row may draft: drafting stops there.
        host_checks: whether each step may read the device to stop once every row has ended.
        temperature: the draft temperature T_d, or one per row ``[R, 1]``.
        keep_probs: whether to keep q over the whole vocabulary at each position.
    """

    draft: BatchedLM
    draws: Draws
    rows: list[int]
    masking: constrained.Masking
    ids: torch.Tensor
    valid: torch.Tensor
    hidden: torch.Tensor | None
    asked: torch.Tensor
    retrieving: torch.Tensor
    forcing: set[int]
    retrieval: Retrieval | None
    budget: torch.Tensor
    eos: torch.Tensor
    stops_at_eos: torch.Tensor
    longest: int
    host_checks: bool
    temperature: float | torch.Tensor
    keep_probs: bool
    sampling: RowSampling | None = None
    drafts: list[torch.Tensor] = field(default_factory=list)  # [R] token per drawn position
    logqs: list[torch.Tensor] = field(default_factory=list)  # [R] log q of each
    probs: list[torch.Tensor] = field(default_factory=list)  # [R, V] q at each, if kept
    fed: int = 0  # drafted tokens the draft has read: it holds [pending, d_1..d_fed]
    pending_fed: bool = False  # a forward has read the rows' queued tokens
    drawn_at: list[int] = field(default_factory=list)  # the positions a draft forward drew
    uniforms: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> its draws [R]

    def __post_init__(self) -> None:
        self.forcing_rows = torch.zeros_like(self.asked)
        self.forcing_rows[[self.rows[i] for i in self.forcing]] = True
        self.ended = ~(self.asked | self.retrieving | self.forcing_rows)
        self.any_asked = bool(self.asked.any())
        self.only_forcing = not self.any_asked and not bool(self.retrieving.any())
        self.reads_hidden = self.hidden is not None
        self.device = self.asked.device
        self.n_rows = len(self.asked)

    def step(self, j: int) -> None:
        """Draw position ``j`` of every row's block: forced where constraints leave one token."""
        allowed = self.masking.next_masks(self.drafts)  # proposal-mode rows sample allowed tokens only
        self._end_dead_rows()
        retrieved = set(self.retrieval.requests("retrieval")) if self.retrieval is not None else set()
        by_draft = {i: m for i, m in allowed.items() if i not in retrieved and i not in self.forcing}
        if self._model_drafts():
            others = self.ended | self.retrieving | self.forcing_rows
            masks = constrained.live_masks(by_draft, self.rows, others)  # None: free
            # A feature draft never skips: its next input is the state this forward predicts.
            d = None if masks is None or self.reads_hidden else constrained.forced_tokens(masks, self.n_rows)
            d, q = (
                self._forced_step(d.to(self.device)) if d is not None else self._draft_step(masks, by_draft)
            )
        else:  # only retrieval rows draft: no forward
            d = torch.zeros(self.n_rows, dtype=torch.long, device=self.device)
            q = (
                torch.zeros(self.n_rows, self.draft.vocab_size, device=self.device)
                if self.keep_probs
                else None
            )
            self.logqs.append(torch.zeros(self.n_rows, device=self.device))
        if retrieved:
            self._retrieve(j, d, q, {i: m for i, m in allowed.items() if i in retrieved})
        if self.forcing:
            self._force(d, q, {i: m for i, m in allowed.items() if i in self.forcing})
        if self.retrieval is not None:
            self.retrieval.advance(d.tolist())
        self.drafts.append(d)
        if self.keep_probs:
            self.probs.append(q)
        self.ended |= (torch.isin(d, self.eos) & self.stops_at_eos) | (self.budget <= j + 1)
        self._end_dead_rows()

    def finished(self, j: int) -> bool:
        """Whether drafting stops after position ``j``: no later token could count."""
        return j + 1 >= self.longest or (self.host_checks and bool(self.ended.all()))

    def drawn(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Tokens ``[R, k]`` and their log q ``[R, k]``, q ``[R, k, V]`` if kept (on the device)."""
        tokens = torch.stack(self.drafts, 1)
        logq = torch.stack(self.logqs, 1)
        return tokens, logq, torch.stack(self.probs, 1) if self.probs else None

    def _model_drafts(self) -> bool:
        """Whether a row the draft model drafts may still count (on a CPU: checked on the device)."""
        if not self.any_asked:
            return False
        return not (self.retrieval is not None and self.host_checks) or bool((self.asked & ~self.ended).any())

    def _retrieve(self, j: int, d: torch.Tensor, q: torch.Tensor | None, allowed: dict) -> None:
        """Retrieval rows' tokens at position ``j``, written into ``d``, q and log q (a host read)."""
        items, r = self.retrieval.retrieved(j, (~self.ended).tolist(), self.device)
        if items:
            probs = torch.zeros(self.n_rows, self.draft.vocab_size, device=self.device)
            rows = torch.tensor([self.rows[i] for i in items], device=self.device)
            probs[rows] = r
            self.masking.restrict(probs, {i: allowed[i] for i in items if i in allowed})
            keep = [n for n, i in enumerate(items) if i not in self.masking.cut_at]
            items, rows = [items[n] for n in keep], rows[keep]
            tokens, log_r = self.retrieval.draw(items, probs[rows], self._uniforms(j)[rows])
            if items:
                d[rows] = torch.tensor(tokens, device=self.device)
                self.logqs[-1][rows] = torch.tensor(log_r, device=self.device)
                if q is not None:
                    q[rows] = probs[rows]
        if self.retrieval.ended_at:
            self.ended[[self.rows[i] for i in self.retrieval.ended_at]] = True

    def _force(self, d: torch.Tensor, q: torch.Tensor | None, allowed: dict[int, torch.Tensor]) -> None:
        """Rows decoding alone take their one allowed token (q a point mass); a choice ends their block.

        Where the block ends, the target draws the bonus as it would have: the decision reads
        the prefix only, so the weights stay proper.
        """
        for i, mask in allowed.items():
            r = self.rows[i]
            if int(mask.sum()) == 1:
                d[r] = int(mask.nonzero()[0, 0])
                self.logqs[-1][r] = 0.0
                if q is not None:
                    q[r] = torch.nn.functional.one_hot(d[r], q.shape[-1]).to(q.dtype)
            else:
                self.masking.cut_at[i] = self.masking.position
                self.ended[r] = True

    def _uniforms(self, j: int) -> torch.Tensor:
        """Position ``j``'s uniforms ``[R]``, the same for the draft's rows and retrieval's."""
        if j not in self.uniforms:
            self.uniforms[j] = self.draws(j).to(self.device)
        return self.uniforms[j]

    def _end_dead_rows(self) -> None:
        ended = self.masking.ended_at()
        if ended:
            self.ended[[self.rows[i] for i in ended]] = True

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
        self.drawn_at.append(len(self.drafts))
        if vocab is None and self.sampling is not None:  # q processed as the target is: more pass
            t = torch.as_tensor(self.temperature, device=logits.device).flatten().expand(self.n_rows)
            rows = torch.arange(self.n_rows, device=logits.device)
            q = torch.softmax(processed(logits[:, -1].float(), t, rows, self.sampling), -1)
        else:
            q = torch.softmax(logits[:, -1].div_(self.temperature), -1)  # [R, V], or [R, U] over vocab
        if vocab is not None:
            q = q.new_zeros(len(q), vocab_size).index_copy_(1, vocab.to(q.device), q)
        if self.retrieval is not None:
            self.retrieval.mix_into(q)
        self.masking.restrict(q, allowed)
        d = inverse_cdf(q, self._uniforms(len(self.drafts)))
        self.logqs.append(drawn_log_probs(q, d))
        self.ids, self.valid = d[:, None], self.asked[:, None]
        if self.reads_hidden:  # the draft's own predicted state goes with its next token
            self.hidden = self.draft.hidden[:, -1:]
        return d, q

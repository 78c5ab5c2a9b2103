"""The block engine: batched drafting and fused verification over all rows.

It owns the draft and target backends, the tokens each row has generated but
not yet fed to each model (the deferred bonus token, the last drafted token),
and the run's random generator. Particles only hold their row index.

A feature draft (``feature_draft.FeatureDraft``) reads, with each token, the target's
hidden state at the position before it. Inside a block it feeds back its own predicted
states; after verification those speculative positions are dropped and the kept tokens
are queued again with the target's true states from the fused forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..backends.base import BatchedLM, check_finite, pad_left
from ..config import SMCConfig
from ..potentials.constraints import Constraint
from ..spec import (
    block_log_weights,
    cut_divergence,
    first_cut,
    pick,
    power_log_normalizer,
    sample_probs,
    sample_tokens,
)
from . import constrained
from .schedule import DraftRecord, draft_step_cost

CONSTRAINT_MODES = ("proposal", "critic")


@dataclass(frozen=True)
class RowConstraint:
    """A hard constraint on one particle's next block.

    Attributes:
        constraint: answers ``next_mask(contexts)`` (see ``smcsd_ppl.potentials``).
        mode: ``"proposal"``: the draft samples only allowed tokens (q masked and
            renormalized); ``"critic"``: the draft samples freely and a block with an
            impossible token is cut before it and gets zero weight.
        context: the tokens the particle has generated so far.
    """

    constraint: Constraint
    mode: str
    context: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.mode not in CONSTRAINT_MODES:
            raise ValueError(f"constraint mode must be one of {CONSTRAINT_MODES}, got {self.mode!r}")


@dataclass
class DraftedBlock:
    """The tokens drafted for one row in a cycle, and how many of them count."""

    row: int
    tokens: list[int]  # all drafted tokens: K, or fewer when every row of the call ended sooner
    draft_logq: torch.Tensor  # [k] log q(d_j | .) at T_d
    kept: int  # tokens that count: an EOS (included) or the budget cuts the rest
    stops: bool  # the block itself ends the particle (drafted EOS or budget): no bonus
    budget: int  # tokens the particle could still emit before this block
    draft_probs: torch.Tensor | None = None  # [k, V] q at each drafted position, on request
    constraint: RowConstraint | None = None
    dead: bool = False  # the constraint allowed nothing where the block ends: zero weight
    fed: int = 0  # drafted tokens the draft model has read (k-1, fewer after forced tokens)
    diverged: bool = False  # the quality cut ended the block (``SMCConfig.cut``)

    @property
    def kept_tokens(self) -> list[int]:
        """The drafted tokens that count."""
        return self.tokens[: self.kept]

    @property
    def log_q(self) -> float:
        """Log-density of the kept tokens under the proposal."""
        return float(self.draft_logq[: self.kept].sum())


@dataclass
class ScoredBlock:
    """A drafted block after the target's fused forward."""

    drafted: DraftedBlock
    target_logp: torch.Tensor  # [K] alpha-free log p_T(d_j | .)
    bonus: int | None  # token drawn from the target after the kept prefix
    stops: bool  # the particle ends here: the block stopped, the bonus is EOS, or the budget is spent
    bonus_log_z: float  # log sum_v p_T(v)^alpha at the bonus position (0 if alpha = 1)
    log_weight: float  # the SMC-SD increment: sum over kept of (alpha log p - log q) + bonus_log_z


def block_length(blocks: Sequence[DraftedBlock]) -> int:
    """The common length of blocks drafted in one ``draft_blocks`` call."""
    lengths = {len(b.tokens) for b in blocks}
    if len(lengths) != 1:
        raise ValueError(f"blocks verified together must be drafted together (lengths {sorted(lengths)})")
    return lengths.pop()


class BlockEngine:
    """Batched draft-and-verify over rows of a draft and a target backend."""

    def __init__(
        self,
        target: BatchedLM,
        draft: BatchedLM,
        eos_token_ids: Sequence[int],
        config: SMCConfig,
        record: DraftRecord | None = None,
    ):
        if target.vocab_size != draft.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size}); "
                "SMC-SD needs a draft that shares the target's tokenizer"
            )
        devices = {str(getattr(lm, "device", "cpu")) for lm in (target, draft)}
        if len(devices) > 1:
            raise ValueError(f"draft and target are on different devices {sorted(devices)}: use one device")
        self.target, self.draft, self.config = target, draft, config
        self.record = record if record is not None else DraftRecord()  # the draft's history, for cuts
        self.draft_ready = False  # the draft holds the rows (start() may skip it)
        self.eos = set(int(e) for e in eos_token_ids)
        self.device = getattr(target, "device", torch.device("cpu"))
        self.g = torch.Generator(device=self.device).manual_seed(config.seed)
        self.g_cpu = torch.Generator().manual_seed(config.seed + 1)
        # Whether drafting may read the device each step to stop once every row has ended:
        # free on a CPU, a sync on an accelerator (tests turn it off to count the latter's reads).
        self.early_stop_reads = self.device.type == "cpu"
        self.target_pending: list[list[int]] = []
        self.draft_pending: list[list[int]] = []
        # One drafted position's cost relative to a target step, for adaptive drafting.
        self.draft_cost = draft_step_cost(
            getattr(draft, "n_params", None), getattr(target, "n_params", None), self.device.type
        )
        self.features = bool(getattr(draft, "reads_hidden", False))
        if self.features:
            if not hasattr(target, "keep_hidden_states"):
                raise ValueError("a feature draft needs a target backend that returns hidden states")
            target.keep_hidden_states()
        self.draft_feats: list[torch.Tensor] = []  # per row: target states paired with draft_pending
        self._verified: tuple[list[int], torch.Tensor] | None = None  # rows, states [n, k+1, H]

    @property
    def n_rows(self) -> int:
        """Rows held by the backends."""
        return len(self.target_pending)

    @torch.inference_mode()
    def start(
        self,
        prompts: Sequence[Sequence[int]],
        copies: int | Sequence[int],
        constraints: Sequence[Constraint | None] | None = None,
        *,
        draft: bool = True,
    ) -> tuple[list[int], list[float]]:
        """Prefill both models, draw each request's first token x0 from the target.

        Returns x0 per prompt and its log-normalizer (nonzero only when alpha != 1).
        Rows are then ``copies`` (or ``copies[i]``) consecutive forks of each prompt. ``draft=False`` leaves
        the draft out, for runs whose requests all decode with the target alone.
        """
        logits = self.target.prefill(prompts)  # [B, V]
        self.draft_ready = draft
        if draft and self.features:  # token j of a prompt goes with the target's state at j-1
            h = self.target.hidden  # [B, W, H], left-padded
            zero, w = h.new_zeros(1, h.shape[-1]), h.shape[1]
            states = [torch.cat([zero, h[i, w - len(p) : w - 1]]) for i, p in enumerate(prompts)]
            self.draft.prefill(prompts, states)
            last = h[:, -1]
        elif draft:
            self.draft.prefill(prompts)
        c = self.config
        log_z0 = power_log_normalizer(logits, c.target_temperature, c.alpha)
        power = c.alpha * logits / c.target_temperature
        if constraints is not None and any(x is not None for x in constraints):
            first = [RowConstraint(x, "proposal", ()) if x is not None else None for x in constraints]
            blocks = [_FirstToken(x) for x in first]
            power = constrained.restrict_bonus(power, log_z0, blocks)
            if not torch.isfinite(log_z0).all():
                raise ValueError("the constraint allows no first token: no output can satisfy it")
        x0 = sample_tokens(power, 1.0, self.g)
        copies = torch.as_tensor(copies, device=self.device)  # one count for all, or one per prompt
        rows = torch.arange(len(prompts), device=self.device).repeat_interleave(copies)
        self.target.fork(rows)
        if draft:
            self.draft.fork(rows)
        self.target_pending = [[int(x0[i])] for i in rows.tolist()]
        self.draft_pending = [[int(x0[i])] for i in rows.tolist()]
        self.draft_feats = [last[i][None] for i in rows.tolist()] if self.features and draft else []
        return x0.tolist(), log_z0.tolist()

    @torch.inference_mode()
    def draft_blocks(
        self,
        rows: Sequence[int],
        budgets: Sequence[int],
        *,
        keep_probs: bool = False,
        constraints: Sequence[RowConstraint | None] | None = None,
        limits: Sequence[int] | None = None,
    ) -> list[DraftedBlock]:
        """Up to K batched draft forwards over all rows; rows not asked for are fed holes.

        ``budgets[i]`` is how many more tokens row ``rows[i]`` may emit; ``keep_probs``
        also returns q over the whole vocabulary (exact speculative sampling needs it);
        ``constraints[i]`` optionally constrains row ``rows[i]``'s block; ``limits[i]`` caps
        how many of its drafted tokens may count (0: the row does not draft). Drafting stops
        early once every asked row has ended (an EOS, its budget, a constraint's dead
        end): no later token could count, so all blocks of the call are that much shorter.
        On an accelerator, unconstrained drafting stops early on budgets only: spotting
        EOS tokens would cost a host sync per step.
        Where a constraint leaves every drafting row one allowed token, q is a point mass
        whatever the draft says: that step skips its forward and the token is fed with the
        next one. Where every drafting row is constrained to a few tokens, the draft computes
        the logits of those tokens only.
        """
        k, t_d = self.config.block_size, self.config.draft_temperature
        keep_probs = keep_probs or self.config.cut is not None  # the cut compares q with p
        vocab_size = self.draft.vocab_size
        rows, budgets = list(rows), list(budgets)
        constraints = list(constraints) if constraints is not None else [None] * len(rows)
        limits = [k] * len(rows) if limits is None else [min(k, n) for n in limits]
        if not any(limits):  # nobody drafts: the target alone decodes this cycle
            blocks = [self._cut(r, [], torch.zeros(0), b, None, None, 0) for r, b in zip(rows, budgets)]
            for block, constraint in zip(blocks, constraints):
                block.constraint = constraint
            return blocks
        asked = torch.zeros(self.n_rows, dtype=torch.bool)
        asked[[r for r, n in zip(rows, limits) if n > 0]] = True
        feed = [p if a else [] for p, a in zip(self.draft_pending, asked.tolist())]
        ids, valid = pad_left(feed, self.device)
        feats = self._pending_features(ids.shape[1], asked.tolist()) if self.features else None
        asked = asked.to(self.device)
        masking = constrained.Masking(rows, constraints, "proposal")
        critic = constrained.Masking(rows, constraints, "critic")
        drafts, logqs, probs = [], [], []
        fed = 0  # drafted tokens the draft has read: it holds [pending, d_1..d_fed]
        pending_fed = False
        ended = ~asked
        budget = torch.full((self.n_rows,), k, device=self.device)
        budget[rows] = torch.tensor([min(b, n) for b, n in zip(budgets, limits)], device=self.device)
        eos = torch.tensor(sorted(self.eos), dtype=torch.long, device=self.device)
        longest = max(min(b, n) for b, n in zip(budgets, limits))
        # Masks already bring every step to the host; on a CPU the check is free anyway.
        host_checks = self.early_stop_reads or bool(masking.items)
        for j in range(k):
            allowed = masking.next_masks(drafts)  # proposal-mode rows sample allowed tokens only
            if masking.dead_at:
                ended[[rows[i] for i in masking.dead_at]] = True
            masks = constrained.live_masks(allowed, rows, ended)  # None: some row samples freely
            # A feature draft never skips: its next input is the state this forward predicts.
            d = None if masks is None or self.features else constrained.forced_tokens(masks, self.n_rows)
            if d is not None:
                d = d.to(self.device)
                q = torch.nn.functional.one_hot(d, vocab_size).float() if keep_probs else None
                logqs.append(torch.zeros(self.n_rows, device=self.device))
                ids, valid = torch.cat([ids, d[:, None]], 1), torch.cat([valid, asked[:, None]], 1)
            else:
                extra = (feats,) if self.features else ()
                vocab = None if masks is None else constrained.shared_vocab(masks, vocab_size)
                kw = {} if vocab is None else {"vocab": vocab}  # logits of allowed tokens only
                logits = self.draft.extend(ids, valid, *extra, **kw)
                fed, pending_fed = len(drafts), True
                q = torch.softmax(logits[:, -1].div_(t_d), -1)  # [R, V], or [R, U] over vocab
                if vocab is not None:
                    q = q.new_zeros(len(q), vocab_size).index_copy_(1, vocab.to(q.device), q)
                masking.restrict(q, allowed)
                d = sample_probs(q, self.g)
                logqs.append(q.gather(-1, d[:, None])[:, 0].log())
                ids, valid = d[:, None], asked[:, None]
                if self.features:  # the draft's own predicted state goes with its next token
                    feats = self.draft.hidden[:, -1:]
            drafts.append(d)
            if keep_probs:
                probs.append(q)
            ended |= torch.isin(d, eos) | (budget <= j + 1)
            if masking.dead_at:
                ended[[rows[i] for i in masking.dead_at]] = True
            if j + 1 >= longest or (host_checks and bool(ended.all())):
                break
        k = len(drafts)
        tokens = torch.stack(drafts, 1).cpu()  # [R, k]
        logq = torch.stack(logqs, 1).cpu()
        q_all = torch.stack(probs, 1) if probs else None  # [R, k, V]
        dead_at = masking.dead_at | critic.first_impossible(tokens)  # request -> position
        for r, n in zip(rows, limits):
            if pending_fed and n:  # else the draft has read nothing yet: the pending tokens stay queued
                self.draft_pending[r] = []
            if self.features and n:
                self.draft_feats[r] = self.draft_feats[r][:0]
        blocks = []
        for i, (r, b, n) in enumerate(zip(rows, budgets, limits)):
            q = q_all[r] if keep_probs else None
            block = self._cut(r, tokens[r].tolist(), logq[r], b, q, dead_at.get(i), n)
            block.constraint, block.fed = constraints[i], fed if n else 0
            blocks.append(block)
        return blocks

    def _pending_features(self, width: int, asked: list[bool]) -> torch.Tensor:
        """The queued target states ``[R, width, H]``, left-padded like ``pad_left``."""
        some = self.draft_feats[0]
        out = torch.zeros(self.n_rows, width, some.shape[-1], dtype=some.dtype, device=self.device)
        for r, (f, a) in enumerate(zip(self.draft_feats, asked)):
            if a and len(f):
                out[r, width - len(f) :] = f
        return out

    def _cut(self, row, tokens, logq, budget, probs, dead_at, limit) -> DraftedBlock:
        """Kept length: the row's ``limit``, a constraint's dead end, the first EOS, the budget."""
        end = min(len(tokens), limit, len(tokens) if dead_at is None else dead_at)
        eos_at = next((j for j, t in enumerate(tokens[:end]) if t in self.eos), None)
        kept = min(end if eos_at is None else eos_at + 1, budget)
        stops = (eos_at is not None and eos_at < kept) or kept >= budget
        # The constraint, not an EOS, the budget or the limit, ended the block: the particle dies.
        dead = not stops and dead_at is not None and kept == dead_at < min(len(tokens), limit)
        return DraftedBlock(row, tokens, logq, kept, stops, budget, probs, dead=dead)

    @torch.inference_mode()
    def target_logits(self, blocks: Sequence[DraftedBlock]) -> torch.Tensor:
        """ONE target forward over [pending, d_1..d_k] for all rows -> ``[n, k+1, V]`` / T_t.

        Position j of the result scores d_{j+1}; position k is the bonus position.
        """
        k = block_length(blocks)
        by_row = {b.row: b for b in blocks}
        feed = [self.target_pending[r] + by_row[r].tokens if r in by_row else [] for r in range(self.n_rows)]
        ids, valid = pad_left(feed, self.device)
        logits = self.target.extend(ids, valid)[:, -(k + 1) :]
        rows = [b.row for b in blocks]
        hidden = self.target.hidden[:, -(k + 1) :] if self.features else None
        if rows != list(range(self.n_rows)):  # usually every row asks: skip the copy
            index = torch.tensor(rows, device=self.device)
            logits = logits.index_select(0, index)
            hidden = hidden.index_select(0, index) if hidden is not None else None
        if hidden is not None:
            self._verified = (rows, hidden)  # commit() queues the kept tokens' true states
        return logits.div_(self.config.target_temperature)

    @torch.inference_mode()
    def verify_blocks(self, blocks: Sequence[DraftedBlock]) -> list[ScoredBlock]:
        """SMC-SD verification: score every block in one forward, draw bonus tokens, commit."""
        c, k = self.config, block_length(blocks)
        logits = self.target_logits(blocks)  # [n, k+1, V]
        if c.cut is not None and k:
            blocks = self._quality_cut(blocks, logits[:, :k])
        drafted = torch.tensor([b.tokens for b in blocks], dtype=torch.long, device=self.device)
        token_logp = pick(torch.log_softmax(logits[:, :k], -1), drafted).cpu()  # [n, K]
        kept = torch.tensor([b.kept for b in blocks], device=self.device)
        at_bonus = logits[torch.arange(len(blocks), device=self.device), kept]  # [n, V]
        bonus_log_z = power_log_normalizer(at_bonus, 1.0, c.alpha)
        # Constrained rows draw the bonus from the target restricted to allowed tokens;
        # its weight is then the allowed mass of p^alpha (-inf when nothing is allowed).
        power = constrained.restrict_bonus(c.alpha * at_bonus, bonus_log_z, blocks)
        bonus = sample_tokens(power, 1.0, self.g).tolist()
        bonus_log_z = bonus_log_z.cpu()
        for i, ok in enumerate(constrained.check_bonus(blocks, bonus)):
            if not ok and not blocks[i].stops:  # a critic's bonus broke the constraint
                bonus_log_z[i] = -math.inf
        going = torch.tensor([not b.stops for b in blocks])
        dead = torch.tensor([b.dead for b in blocks])
        has_bonus = going & torch.isfinite(bonus_log_z) & ~dead
        draft_logq = torch.stack([b.draft_logq for b in blocks])
        log_w = block_log_weights(token_logp, draft_logq, kept.cpu(), bonus_log_z, has_bonus, c.alpha)
        # A dead block, or a row that must go on but has no allowed bonus token: zero weight.
        log_w = log_w.masked_fill(dead | (going & ~has_bonus), -math.inf).tolist()
        if any(math.isnan(w) for w in log_w):  # NaN logits show here, already on the host
            check_finite(self.target, self.draft)
        out, nexts = [], []
        for i, b in enumerate(blocks):
            nxt = bonus[i] if has_bonus[i] else None
            ends = nxt is None or nxt in self.eos or b.kept + 1 >= b.budget or b.dead
            out.append(ScoredBlock(b, token_logp[i], nxt, ends, float(bonus_log_z[i]), log_w[i]))
            nexts.append(None if ends else nxt)  # an ending row queues nothing and leaves
        self.commit(blocks, [b.kept for b in blocks], nexts)
        return out

    def _quality_cut(self, blocks: list[DraftedBlock], logits: torch.Tensor) -> list[DraftedBlock]:
        """Cut each block where D(p || q) first exceeds ``config.cut``; the bonus is drawn there.

        ``logits [n, k, V]`` are l / T_t at the drafted positions. The cut position depends
        on the prefix only; a dead block (the constraint allowed nothing) comes alive when
        the cut falls at or before the token that killed it, since that token is dropped.
        """
        c = self.config
        q = torch.stack([b.draft_probs for b in blocks]).to(logits.device)  # [n, k, V]
        restrict = [b.constraint is not None and b.constraint.mode == "proposal" for b in blocks]
        div = cut_divergence(logits, q, c.alpha, c.cut_divergence, torch.tensor(restrict, device=q.device))
        full = torch.full((len(blocks),), logits.shape[1], device=div.device)
        cuts = first_cut(div, c.cut, full).tolist()
        out = []
        for b, at in zip(blocks, cuts):
            if at < b.kept or (b.dead and at == b.kept):
                b = replace(b, kept=at, stops=False, dead=False, diverged=True)
            out.append(b)
        return out

    def commit(
        self, blocks: Sequence[DraftedBlock], kept: Sequence[int], nexts: Sequence[int | None]
    ) -> None:
        """Keep ``kept[i]`` drafted tokens of each block, queue the next token, hole out the rest.

        After a forward the target holds [pending, d_1..d_k] and the draft [pending,
        d_1..d_fed] (fed = k-1 unless forced tokens skipped forwards); both then await
        the next token (the deferred bonus), the draft also the kept tokens it has not
        read. Rows without a next token stop and leave at the next ``reorder``. A feature
        draft drops all its drafted positions (computed from predicted states) and queues
        the kept tokens again with the target's states from ``target_logits``.
        """
        k = block_length(blocks) if blocks else 0
        drop_t, drop_d = {}, {}
        states = None
        if self.features:
            rows, hidden = self._verified
            states = dict(zip(rows, hidden))
        for b, n, nxt in zip(blocks, kept, nexts):
            tail = [] if nxt is None else [nxt]
            self.target_pending[b.row] = tail
            if states is not None:
                self.draft_pending[b.row] = b.tokens[:n] + tail if tail else []
                self.draft_feats[b.row] = states[b.row][: n + 1] if tail else states[b.row][:0]
            else:
                self.draft_pending[b.row] = self.draft_pending[b.row] + b.tokens[b.fed : n] + tail
            if nxt is not None:
                drop_t[b.row] = k - n
                # A feature draft read its fed tokens with predicted states: all are dropped.
                drop_d[b.row] = b.fed if states is not None else max(0, b.fed - n)
        self._drop(self.target, drop_t)
        self._drop(self.draft, drop_d)

    def _drop(self, backend: BatchedLM, n_by_row: dict[int, int]) -> None:
        if any(n_by_row.values()):
            n = torch.zeros(self.n_rows, dtype=torch.long)
            for r, d in n_by_row.items():
                n[r] = d
            backend.drop_tail(n)

    def reorder(self, rows: Sequence[int]) -> None:
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
        if self.features:
            self.draft_feats = [self.draft_feats[r] for r in rows]


@dataclass
class _FirstToken:
    """The empty block before x0, so the first token is drawn like a constrained bonus."""

    constraint: RowConstraint | None
    stops: bool = False
    kept_tokens: tuple = ()

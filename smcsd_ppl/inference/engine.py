"""The block engine: batched drafting and fused verification over all rows.

It owns the draft and target backends, the tokens each row has generated but
not yet fed to each model (the deferred bonus token, the last drafted token),
and the run's random generator. Particles only hold their row index.

A feature draft (``models.feature_draft.FeatureDraft``) reads, with each token, the target's
hidden state at the position before it. Inside a block it feeds back its own predicted
states; after verification those speculative positions are dropped and the kept tokens
are queued again with the target's true states from the fused forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..backends.base import BatchedLM, check_finite, pad_left, pad_left_hidden, to_device
from ..config import SMCConfig
from ..potentials.constraints import Constraint
from ..spec import (
    block_log_weights,
    cut_divergence,
    first_cut,
    pick,
    power_log_normalizer,
    sample_tokens,
)
from . import constrained
from .blocks import DraftedBlock, FirstToken, RowConstraint, ScoredBlock, block_length
from .drafting import Drafting
from .schedule import DraftRecord, draft_step_cost


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
        self.reads_hidden = bool(getattr(draft, "reads_hidden", False))
        if self.reads_hidden:
            if not hasattr(target, "keep_hidden_states"):
                raise ValueError("a feature draft needs a target backend that returns hidden states")
            target.keep_hidden_states()
        self.draft_hidden: list[torch.Tensor] = []  # per row: target states paired with draft_pending
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
        if draft and self.reads_hidden:  # token j of a prompt goes with the target's state at j-1
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
            blocks = [FirstToken(x) for x in first]
            power = constrained.restrict_bonus(power, log_z0, blocks)
            if not torch.isfinite(log_z0).all():
                raise ValueError("the constraint allows no first token: no output can satisfy it")
        x0 = sample_tokens(power, 1.0, self.g)
        # Rows on the host: the backends fork without reading them back (one count, or one per prompt).
        rows = torch.arange(len(prompts)).repeat_interleave(torch.as_tensor(copies))
        self.target.fork(rows)
        if draft:
            self.draft.fork(rows)
        firsts, rows = x0.tolist(), rows.tolist()
        self.target_pending = [[firsts[i]] for i in rows]
        self.draft_pending = [[firsts[i]] for i in rows]
        self.draft_hidden = [last[i][None] for i in rows] if self.reads_hidden and draft else []
        return firsts, log_z0.tolist()

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
        k = self.config.block_size
        rows, budgets = list(rows), list(budgets)
        constraints = list(constraints) if constraints is not None else [None] * len(rows)
        limits = [k] * len(rows) if limits is None else [min(k, n) for n in limits]
        if not any(limits):  # nobody drafts: the target alone decodes this cycle
            return self._undrafted(rows, budgets, constraints)
        keep_probs = keep_probs or self.config.cut is not None  # the cut compares q with p
        run = self._feed(rows, budgets, limits, constraints, keep_probs)
        for j in range(k):
            run.step(j)
            if run.finished(j):
                break
        return self._cut_blocks(run, budgets, constraints, limits)

    def _undrafted(self, rows, budgets, constraints) -> list[DraftedBlock]:
        """Empty blocks, for a cycle where the target alone decodes."""
        blocks = [self._cut(r, [], torch.zeros(0), b, None, None, 0) for r, b in zip(rows, budgets)]
        for block, constraint in zip(blocks, constraints):
            block.constraint = constraint
        return blocks

    def _feed(self, rows, budgets, limits, constraints, keep_probs: bool) -> Drafting:
        """Start drafting: each asked row's queued tokens (and target states) are the first input."""
        asked = torch.zeros(self.n_rows, dtype=torch.bool)
        asked[[r for r, n in zip(rows, limits) if n > 0]] = True
        feed = [p if a else [] for p, a in zip(self.draft_pending, asked.tolist())]
        ids, valid = pad_left(feed, self.device)
        hidden = None
        if self.reads_hidden:  # the target's states queued with the tokens
            queued = [f if a else f[:0] for f, a in zip(self.draft_hidden, asked.tolist())]
            hidden = pad_left_hidden(queued, ids.shape[1]).to(self.device)
        caps = [min(b, n) for b, n in zip(budgets, limits)]
        budget = torch.full((self.n_rows,), self.config.block_size, device=self.device)
        budget[rows] = torch.tensor(caps, device=self.device)
        masking = constrained.Masking(rows, constraints, "proposal")
        return Drafting(
            draft=self.draft,
            g=self.g,
            rows=rows,
            masking=masking,
            ids=ids,
            valid=valid,
            hidden=hidden,
            asked=asked.to(self.device),
            budget=budget,
            eos=torch.tensor(sorted(self.eos), dtype=torch.long, device=self.device),
            longest=max(caps),
            # Masks already bring every step to the host; on a CPU the check is free anyway.
            host_checks=self.early_stop_reads or bool(masking.items),
            temperature=self.config.draft_temperature,
            keep_probs=keep_probs,
        )

    def _cut_blocks(self, run: Drafting, budgets, constraints, limits) -> list[DraftedBlock]:
        """Each request's block from the drawn tokens, cut by ``_cut``; the draft's queue is read."""
        tokens, logq, q_all = run.drawn()
        critic = constrained.Masking(run.rows, constraints, "critic")
        dead_at = run.masking.dead_at | critic.first_impossible(tokens)  # request -> position
        for r, n in zip(run.rows, limits):
            if run.pending_fed and n:  # else the draft has read nothing yet: the pending tokens stay queued
                self.draft_pending[r] = []
            if self.reads_hidden and n:
                self.draft_hidden[r] = self.draft_hidden[r][:0]
        blocks = []
        for i, (r, b, n) in enumerate(zip(run.rows, budgets, limits)):
            q = q_all[r] if run.keep_probs else None
            block = self._cut(r, tokens[r].tolist(), logq[r], b, q, dead_at.get(i), n)
            block.constraint, block.fed = constraints[i], run.fed if n else 0
            blocks.append(block)
        return blocks

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
        hidden = self.target.hidden[:, -(k + 1) :] if self.reads_hidden else None
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
        mask = to_device(torch.tensor(restrict), q.device) if any(restrict) else None  # decided on the host
        cuts = first_cut(cut_divergence(logits, q, c.alpha, c.cut_divergence, mask), c.cut).tolist()
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
        if self.reads_hidden and self.draft_ready:
            rows, hidden = self._verified
            states = dict(zip(rows, hidden))
        for b, n, nxt in zip(blocks, kept, nexts):
            tail = [] if nxt is None else [nxt]
            self.target_pending[b.row] = tail
            if states is not None:
                self.draft_pending[b.row] = b.tokens[:n] + tail if tail else []
                self.draft_hidden[b.row] = states[b.row][: n + 1] if tail else states[b.row][:0]
            elif self.draft_ready:  # else decoding alone: the draft has nothing to keep in step
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
        if self.reads_hidden:
            self.draft_hidden = [self.draft_hidden[r] for r in rows]

"""One SMC-SD cycle as a pure function of tensors: draft K, verify, weigh, resample, no host read.

This is the paper's algorithm (fixed N and K, no quality cut, the draft as proposal) for B
requests of N particles each, R = B x N rows, exactly as the eager kernel runs it
(``inference.step``, ``inference.cycle``): the same uniforms per row and purpose, the same
verification (``verification.verify_blocks``), the same weights in float64 and the same
resampling arithmetic, so a seeded request gives the eager path's tokens. Shapes are static:
a finished particle's row steps on as a hole and its outputs are ignored. Resampling gathers
the particles' state here; their KV rows are copied after the cycle by the host, which reads
the ancestors in the report anyway, and only for rows whose ancestor is another
(``Arena.move_rows_``): gathering both arenas whole in every cycle cost 31-39 ms on the
embedded pair. The host reads one report per cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..backends.static import Arena, StaticLlama
from ..smc import ESS_SLACK
from ..verification import BlockBatch, drawn_log_probs, inverse_cdf, verify_blocks


@dataclass
class CycleState:
    """The particles between cycles, on the device (``R`` rows; updated in place by a cycle).

    Attributes:
        pend_t: ``[R]`` the token the target reads next (the last bonus, or the lead).
        pend_d: ``[R, 2]`` the tokens the draft reads next (left hole where ``pend_d_valid`` is False).
        pend_d_valid: ``[R, 2]``.
        log_w: ``[R]`` float64 log-weights.
        done: ``[R]`` the particle has finished.
        n_gen: ``[R]`` tokens it has emitted.
        budget: ``[R]`` ``max_new_tokens``.
        temps: ``[2, R]`` float32 target and draft temperatures.
        eos: ``[E]`` the EOS ids in force (an id outside the vocabulary when none).
        lead_w: ``[R]`` float32 log mass the lead was drawn from (weighed in the first cycle, then 0).
    """

    pend_t: torch.Tensor
    pend_d: torch.Tensor
    pend_d_valid: torch.Tensor
    log_w: torch.Tensor
    done: torch.Tensor
    n_gen: torch.Tensor
    budget: torch.Tensor
    temps: torch.Tensor
    eos: torch.Tensor
    lead_w: torch.Tensor

    def flat(self) -> tuple[torch.Tensor, ...]:
        """The tensors, in field order (as a graph takes them)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def gather_(self, ancestors: torch.Tensor) -> None:
        """Row i takes row ``ancestors[i]``'s particle (in place)."""
        for t in (
            self.pend_t,
            self.pend_d,
            self.pend_d_valid,
            self.log_w,
            self.done,
            self.n_gen,
            self.lead_w,
        ):
            t.copy_(t.index_select(0, ancestors))


N_STATE = len(fields(CycleState))


def smcsd_cycle(target: StaticLlama, draft: StaticLlama, n: int, k: int, alpha: float, threshold: float):
    """The cycle ``(*target arena, *draft arena, *state, u [R, K+2], points [B, N]) -> (report [R, W],)``.

    ``u``: each row's uniforms (lead, draft positions, bonus; ``streams.block_uniforms``);
    ``points``: each request's sorted resampling points in [0, 1). The report (float64, one
    host read) holds per row, before resampling, the tokens emitted and their count; then the
    ancestor each row takes, whether it is done after, its request's ESS, whether the request
    resampled, and whether any logits were NaN.
    """
    n_arena = 2 * len(target.layers) + 1
    m_arena = 2 * len(draft.layers) + 1

    def cycle(*args: torch.Tensor) -> tuple[torch.Tensor]:
        t_arena, d_arena = Arena.of(args[:n_arena]), Arena.of(args[n_arena : n_arena + m_arena])
        s = CycleState(*args[n_arena + m_arena : n_arena + m_arena + N_STATE])
        u, points = args[-2], args[-1]
        live = ~s.done
        tokens, logq, nan_d = _draft(draft, d_arena, s, u, live, k)
        remaining = s.budget - s.n_gen
        limit, stops = _limits(tokens, remaining, s.eos)
        batch = BlockBatch(
            tokens=tokens,
            draft_logq=logq,
            limit=limit,
            stops=stops,
            dead=torch.zeros_like(stops),
            lead_log_w=s.lead_w.clone(),
        )
        feed = torch.cat([s.pend_t[:, None], tokens], 1)
        logits = target.forward(t_arena, feed, live[:, None].expand_as(feed))  # [R, K+1, V]
        nan = nan_d | torch.isnan(logits).any()
        v = verify_blocks(logits / s.temps[0][:, None, None], batch, u[:, -1], alpha=alpha, padded=False)
        ends = v.dead | ~v.has_bonus | torch.isin(v.bonus, s.eos) | (v.kept + 1 >= remaining)
        going = live & ~ends
        zero = torch.zeros_like(v.kept)
        t_arena.lengths.sub_(torch.where(going, k - v.kept, zero))
        d_arena.lengths.sub_(torch.where(going, (k - 1 - v.kept).clamp(min=0), zero))
        emitted = torch.cat([tokens, torch.zeros_like(tokens[:, :1])], 1)
        emitted.scatter_(1, v.kept[:, None], torch.where(v.has_bonus, v.bonus, 0)[:, None])
        count = torch.where(live, v.kept + v.has_bonus.long(), zero)
        s.pend_t.copy_(v.bonus)
        s.pend_d.copy_(torch.stack([tokens[:, -1], v.bonus], 1))
        s.pend_d_valid.copy_(torch.stack([v.kept == k, torch.ones_like(live)], 1))
        s.n_gen.add_(count)
        s.log_w.add_(torch.where(live, v.log_w.double(), 0.0))
        s.done.logical_or_(ends)
        s.lead_w.zero_()
        ancestors, ess, did = resample_rows(s.log_w.view(-1, n), points, threshold)
        s.gather_(ancestors)  # the KV rows follow on the host's side, where a request resampled
        columns = [count, ancestors, s.done.long(), ess.repeat_interleave(n), did.repeat_interleave(n)]
        tail = torch.stack([c.double() for c in columns] + [nan.double().expand(len(count))], 1)
        return (torch.cat([emitted.double(), tail], 1),)

    return cycle


def _draft(draft: StaticLlama, arena: Arena, s: CycleState, u: torch.Tensor, live: torch.Tensor, k: int):
    """K draft forwards (the first reads the queued tokens): tokens ``[R, K]``, log q ``[R, K]``, NaN seen."""
    ids, valid = s.pend_d, s.pend_d_valid & live[:, None]
    tokens, logq, nan = [], [], torch.zeros((), dtype=torch.bool, device=ids.device)
    for j in range(k):
        logits = draft.forward(arena, ids, valid, last_only=True)[:, -1]
        nan = nan | torch.isnan(logits).any()
        q = torch.softmax(logits / s.temps[1][:, None], -1)
        d = inverse_cdf(q, u[:, 1 + j])
        tokens.append(d)
        logq.append(drawn_log_probs(q, d))
        ids, valid = d[:, None], live[:, None]
    return torch.stack(tokens, 1), torch.stack(logq, 1), nan


def _limits(tokens: torch.Tensor, remaining: torch.Tensor, eos: torch.Tensor):
    """Drafted tokens that count (up to the first EOS, or the budget) and whether the block ends there."""
    k = tokens.shape[1]
    position = torch.arange(1, k + 1, device=tokens.device)
    ends = torch.isin(tokens, eos) | (position[None, :] >= remaining[:, None])
    stops = ends.any(1)
    return torch.where(stops, ends.long().argmax(1) + 1, k), stops


def resample_rows(log_w: torch.Tensor, points: torch.Tensor, threshold: float):
    """Per request (``log_w [B, N]``): ancestors ``[B*N]``, ESS ``[B]`` and whether it resampled ``[B]``.

    As ``smc.ess``, ``smc.normalize`` and the resamplers' inverse CDF compute them, in float64;
    a request resamples when ``smc.below_threshold``, taking the mean weight (written into
    ``log_w`` here; the caller gathers the rows).
    """
    b, n = log_w.shape
    clean = torch.nan_to_num(log_w, nan=-math.inf)
    top = clean.max(1, keepdim=True).values
    finite = torch.isfinite(top)
    w = torch.where(finite, torch.exp(clean - torch.where(finite, top, 0.0)), 1.0)
    w = w / w.sum(1, keepdim=True)
    ess = (1.0 / (w * w).sum(1)).clamp(1.0, float(n))
    did = finite[:, 0] & (n >= 2) & (threshold > 0) & (ess < threshold * n * (1 - ESS_SLACK))
    cdf = torch.cumsum(w, 1)
    drawn = torch.searchsorted(cdf / cdf[:, -1:], points, right=True).clamp(max=n - 1)
    own = torch.arange(n, device=log_w.device).expand(b, n)
    local = torch.where(did[:, None], drawn, own)
    mean = torch.logsumexp(clean, 1, keepdim=True) - math.log(n)
    log_w.copy_(torch.where(did[:, None], mean.expand(b, n), clean))
    base = torch.arange(b, device=log_w.device)[:, None] * n
    return (local + base).reshape(-1), torch.where(finite[:, 0], ess, 0.0), did

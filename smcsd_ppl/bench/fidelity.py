"""The fidelity map: SMC-SD's accuracy and tokens per target call against draft quality.

Drafts of controlled quality mix the target into the shipped draft, q = lam p + (1 - lam) q_draft
(at the draft temperature). Such a draft runs a target forward per step, so it is for this
map only, never for speed: the map reports tokens per target call and accuracy, not time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..api import SMCSD
from ..backends.hf import HFBatchedLM
from ..batch.prompts import Prompt
from ..config import SMCConfig
from .quality import check_answer


class MixedDraft:
    """A ``BatchedLM`` whose next-token distribution is lam p_target + (1 - lam) q_draft.

    Both models keep their own rows; the logits returned are T_d log(mixture), so that the
    engine's softmax(logits / T_d) is exactly the mixture at the draft temperature.
    """

    def __init__(self, target: HFBatchedLM, draft: HFBatchedLM, lam: float, draft_temperature: float) -> None:
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam}")
        self.target, self.draft, self.lam, self.t_d = target, draft, lam, draft_temperature
        self.vocab_size, self.device, self.stats = draft.vocab_size, draft.device, draft.stats
        self.max_length = min(target.max_length, draft.max_length)
        # Priced as the draft alone: the map asks what a draft of this agreement at the draft's
        # cost would do; the target forward inside the mixture is a device of the map only.
        self.n_params = draft.n_params
        self.bytes_per_token = target.bytes_per_token + draft.bytes_per_token
        self.max_cache_bytes = min(target.max_cache_bytes, draft.max_cache_bytes)
        self.name = f"mixture draft (lam {lam})"
        self.reads_hidden, self.hidden = False, None  # a mixture of two models has no states of its own

    @property
    def n_rows(self) -> int:
        """Rows currently held."""
        return self.draft.n_rows

    def _mix(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(a.float() / self.t_d, -1)
        q = torch.softmax(b.float() / self.t_d, -1)
        return self.t_d * torch.log((self.lam * p + (1 - self.lam) * q).clamp_min(1e-38))

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Start afresh with one row per prompt; mixed next-token logits ``[B, V]``."""
        return self._mix(self.target.prefill(prompts), self.draft.prefill(prompts))

    def append(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Add one row per prompt after those held, in both models; mixed next-token logits ``[B, V]``."""
        return self._mix(self.target.append(prompts), self.draft.append(prompts))

    def extend(self, tokens, valid=None, hidden=None, *, vocab=None) -> torch.Tensor:
        """Append ``tokens [R, T]`` to both models; mixed logits ``[R, T, V]`` (or ``[R, T, U]``)."""
        if hidden is not None:
            raise ValueError(f"{self.name} takes no hidden states")
        mixed = self._mix(self.target.extend(tokens, valid), self.draft.extend(tokens, valid))
        return mixed if vocab is None else mixed.index_select(-1, vocab.to(mixed.device))

    def fork(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` in order, in both models."""
        self.target.fork(rows)
        self.draft.fork(rows)

    def keep_hidden_states(self) -> None:
        """Refused: the mixture is a draft and has no hidden states of its own."""
        raise ValueError(f"{self.name} has no hidden states to keep")

    def check_finite(self) -> None:
        """Raise if either model produced NaN logits since the last check."""
        self.target.check_finite()
        self.draft.check_finite()

    def drop_tail(self, n: torch.Tensor) -> None:
        """Hole out the last ``n[r]`` real positions of each row, in both models."""
        self.target.drop_tail(n)
        self.draft.drop_tail(n)


@dataclass
class MapPoint:
    """One cell of the map: a draft mixture and SMC-SD settings, over a prompt set."""

    lam: float
    agreement: float  # how often the draft's top token is the target's, on the target's outputs
    n_particles: int
    block_size: int
    cut: float | None
    divergence: str
    accuracy: float
    tokens_per_target_call: float
    mean_ess_fraction: float
    collapsed: float  # share of requests flagged as collapsed


def agreement(pair: SMCSD, prompts: Sequence[Prompt], lams: Sequence[float], config: SMCConfig) -> dict:
    """Greedy agreement of each mixture with the target on the target's own sampled outputs."""
    hits = {lam: 0 for lam in lams}
    total = 0
    for prompt in prompts:
        ids = pair.encode(prompt.text)
        out = pair.generate(prompt.text, method="ar", config=config)
        seq = torch.tensor([ids + out.token_ids[:-1]], device=pair.target_lm.device)
        lp, lq = pair.call(functools.partial(_logits, pair, seq, len(ids)))
        p = torch.softmax(lp / config.draft_temperature, -1)
        q = torch.softmax(lq / config.draft_temperature, -1)
        top = p.argmax(-1)
        for lam in lams:
            hits[lam] += int(((lam * p + (1 - lam) * q).argmax(-1) == top).sum())
        total += len(top)
    return {lam: hits[lam] / max(1, total) for lam in lams}


def map_point(
    pair: SMCSD, prompts: Sequence[Prompt], lam: float, config: SMCConfig, agree: float
) -> MapPoint:
    """Run SMC-SD with the lam-mixture draft on every prompt (fresh draft memory per point)."""
    mixed = SMCSD(pair.target, pair.draft, chat=pair.chat)
    mixed.use_draft_backend(
        MixedDraft(
            HFBatchedLM(pair.target.model, name="mixture target"),
            pair.draft_lm,
            lam,
            config.draft_temperature,
        )
    )
    correct, tokens, calls, ess, collapsed = 0, 0, 0, [], 0
    for prompt in prompts:
        out = mixed.generate(prompt.text, config=config)
        correct += bool(check_answer(out.text, prompt.answer))
        tokens += len(out.token_ids)
        calls += out.stats.target_calls
        ess += [e / config.n_particles for e in out.smc.ess_trace]
        collapsed += out.smc.collapsed
    n = max(1, len(prompts))
    return MapPoint(
        lam,
        agree,
        config.n_particles,
        config.block_size,
        config.cut,
        config.cut_divergence,
        correct / n,
        tokens / max(1, calls),
        sum(ess) / max(1, len(ess)),
        collapsed / n,
    )


def fidelity_map(
    pair: SMCSD,
    prompts: Sequence[Prompt],
    cells: Sequence[tuple[float, int, int, float | None]],
    base: SMCConfig,
    on_point: Callable[[MapPoint], None] | None = None,
) -> list[MapPoint]:
    """Every (lam, N, K, cut) cell over ``prompts``, with each lam's agreement."""
    agree = agreement(pair, prompts, sorted({c[0] for c in cells}), base)
    points = []
    for lam, n, k, cut in cells:
        config = dataclasses.replace(base, n_particles=n, block_size=k, cut=cut)
        points.append(map_point(pair, prompts, lam, config, agree[lam]))
        if on_point is not None:
            on_point(points[-1])
    return points


@torch.inference_mode()
def _logits(pair: SMCSD, seq: torch.Tensor, prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' logits at the positions after the prompt's last token (on the torch thread)."""
    lp = pair.target.model(input_ids=seq).logits[0, prompt - 1 :].float()
    lq = pair.draft.model(input_ids=seq).logits[0, prompt - 1 :].float()
    return lp, lq

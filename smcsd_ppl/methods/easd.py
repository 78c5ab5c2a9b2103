"""EASD: exact speculative sampling plus an entropy-aware rejection rule.

The loop is ``sd.SpeculativeLoop`` with ``verification.easd.easd_accept`` in place of
``speculative_accept``: where both models are uncertain and agree on their top-n, the
drafted token is rejected and replaced by a draw from the target without it.

The default thresholds (``EASDConfig()``) are the 75th percentiles of the draft's and the
target's entropies at drafted positions of SD runs on the default pair (our choice: the
paper sets its thresholds from percentiles on a reasoning set); ``top_n=5`` and
``overlap=0.6`` (3 of 5) read "strongly overlap" literally. The measurement, and how to
repeat it, is in docs/benchmarks.md ("EASD thresholds"). Re-measure for other models or
temperatures: entropies depend on both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..config import SMCConfig
from ..inference.rows import RowStore
from ..results import Generation, SpeculativeInfo
from ..verification.easd import easd_accept, uncertain_agreement
from .registry import RunContext, register
from .sd import AcceptRule, SpeculativeRun, speculative_sampling


@dataclass(frozen=True)
class EASDConfig:
    """EASD's rule: veto d_j when H_q > tau_q, H_p > tau_p and top-n overlap >= ``overlap``.

    Attributes:
        tau_q: draft entropy threshold (nats, q at T_d); p75 on the default pair.
        tau_p: target entropy threshold (nats, p at T_t); p75 on the default pair.
        top_n: size of the top-n sets compared.
        overlap: minimum |topn(q) ∩ topn(p)| / n for a veto.
        enabled: False gives exact speculative sampling (same tokens as ``sd``).
    """

    tau_q: float = 1.11
    tau_p: float = 3.98
    top_n: int = 5
    overlap: float = 0.6
    enabled: bool = True

    def __post_init__(self) -> None:
        for name in ("tau_q", "tau_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"{name} must be an entropy >= 0 (nats; inf disables), got {value!r}")
        if isinstance(self.top_n, bool) or not isinstance(self.top_n, int) or self.top_n < 1:
            raise ValueError(f"top_n must be an integer >= 1, got {self.top_n!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap!r}")


def easd_rule(easd: EASDConfig) -> AcceptRule:
    """EASD's accept rule: veto where both models are uncertain and agree (none when disabled)."""

    def accept(target_probs, draft_probs, tokens, g):
        veto = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
        if easd.enabled:
            rule = dict(tau_q=easd.tau_q, tau_p=easd.tau_p, top_n=easd.top_n, overlap=easd.overlap)
            veto = uncertain_agreement(target_probs[:, :-1], draft_probs, **rule)
        return easd_accept(target_probs, draft_probs, tokens, veto, g)

    return accept


def easd_sampling(
    store: RowStore,
    config: SMCConfig,
    eos: Sequence[int],
    prompts: Sequence[Sequence[int]],
    *,
    easd: EASDConfig | None = None,
    on_step: Callable[[int], None] | None = None,
) -> SpeculativeRun:
    """EASD on a row store, one row per prompt, K drafted tokens per cycle.

    With ``easd.enabled`` False (or infinite thresholds) this is exact speculative
    sampling and draws the same tokens as ``sd.speculative_sampling`` for one seed.
    """
    rule = easd_rule(easd or EASDConfig())
    return speculative_sampling(store, config, eos, prompts, accept=rule, on_step=on_step)


@register(
    "easd",
    samples_target=True,
)
def _easd(ctx: RunContext) -> list[Generation]:
    run = easd_sampling(ctx.rows(), ctx.config, ctx.eos, ctx.prompts, on_step=ctx.on_progress)
    info = [SpeculativeInfo(run.acceptance(i), run.vetoes[i]) for i in range(len(run.token_ids))]
    return ctx.generations(run.token_ids, info)

"""The distillation losses: the draft against the target's top-k, and a feature draft's.

The loss at each position is the ``Objective``'s: the cross-entropy against the top-k (the
KL up to a constant), or a weight objective (``objectives``). Also the target's hidden
states a feature draft is trained on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import MIN_TEMPERATURE, SMCConfig
from ..models import LoadedModel
from ..models.feature_draft import final_hidden
from .data import Example, right_padded
from .objectives import OBJECTIVES, weight_loss


@dataclass(frozen=True)
class Objective:
    """What the draft is trained to minimize at each position.

    Attributes:
        name: ``"kl"`` (cross-entropy against the target's top-k), ``"chi2"`` or ``"renyi2"``
            (the variance of SMC-SD's weights; ``objectives``).
        temperature: T of both models in a weight objective (at least ``MIN_TEMPERATURE``).
        cut: the verify's quality cut a ``chi2`` objective assumes (None: none).
        divergence: the divergence that cut bounds (``verification.DIVERGENCES``).
    """

    name: str = "kl"
    temperature: float = 1.0
    cut: float | None = SMCConfig().cut
    divergence: str = SMCConfig().cut_divergence

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.name!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not MIN_TEMPERATURE <= t < math.inf:
            raise ValueError(f"the objective's temperature must be a number >= {MIN_TEMPERATURE}, got {t!r}")
        SMCConfig(cut=self.cut, cut_divergence=self.divergence)  # the same cuts as the verify's

    def loss(self, logits: torch.Tensor, examples: Sequence[Example]) -> torch.Tensor:
        """The mean loss of ``logits`` (the examples' scored positions, in order)."""
        if self.name == "kl":
            return _topk_ce(logits, examples)
        top_ids = torch.cat([e.top_ids for e in examples]).to(logits.device)
        top_logp = torch.cat([e.top_logp for e in examples]).to(logits.device)
        settings = dict(temperature=self.temperature, cut=self.cut, divergence=self.divergence)
        return weight_loss(logits, top_ids, top_logp, self.name, **settings)


def kd_loss(
    model: torch.nn.Module, examples: Sequence[Example], *, autocast: bool, objective: Objective = Objective()
) -> tuple[torch.Tensor, int]:
    """The draft's mean loss against the target's top-k, and the positions scored."""
    device = model.device
    ids, mask = right_padded([e.ids for e in examples], device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        # position t of a sequence predicts token t+1: the first len-1 positions are scored
        rows = torch.cat([torch.full((len(e.ids) - 1,), r) for r, e in enumerate(examples)])
        cols = torch.cat([torch.arange(len(e.ids) - 1) for e in examples])
        logits = model.lm_head(hidden[rows.to(device), cols.to(device)])
    return objective.loss(logits, examples), len(rows)


def _topk_ce(logits: torch.Tensor, examples: Sequence[Example]) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (the examples' scored positions, in order) against the top-k."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    top_ids = torch.cat([e.top_ids for e in examples]).to(logits.device)
    p = torch.cat([e.top_logp for e in examples]).to(logits.device).float().exp()
    return -(p * logq.gather(1, top_ids)).sum(-1).mean()


def feature_kd_loss(
    model: torch.nn.Module,
    examples: Sequence[Example],
    states: Sequence[torch.Tensor],
    *,
    autocast: bool,
    unroll: int,
    state_weight: float,
    objective: Objective = Objective(),
) -> tuple[torch.Tensor, int]:
    """The objective plus hidden-state regression of a feature draft, over ``unroll`` passes.

    ``states[i]`` are the target's hidden states ``[T, H]`` of example i. Pass 1 feeds the
    target's states; each later pass feeds the previous pass's predictions (detached), as
    the draft's later tokens in a block see them.
    """
    device = model.device
    ids, mask = right_padded([e.ids for e in examples], device)
    true = torch.zeros(*ids.shape, states[0].shape[-1], device=device)
    for row, h in enumerate(states):
        true[row, : len(h)] = h.to(device).float()
    rows = torch.cat([torch.full((len(e.ids) - 1,), r) for r, e in enumerate(examples)]).to(device)
    cols = torch.cat([torch.arange(len(e.ids) - 1) for e in examples]).to(device)
    real = mask.bool()
    fed, loss = true, 0.0
    for _ in range(unroll):
        previous = torch.cat([torch.zeros_like(fed[:, :1]), fed[:, :-1]], 1)  # x_j goes with h_{j-1}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            hidden = model.predict_hidden(ids, previous, attention_mask=mask)
            logits = model.get_output_embeddings()(hidden[rows, cols])
        regression = torch.nn.functional.smooth_l1_loss(hidden.float()[real], true[real])
        loss = loss + objective.loss(logits, examples) + state_weight * regression
        fed = hidden.detach().float()
    return loss / unroll, len(rows)


@torch.inference_mode()
def hidden_states(target: LoadedModel, examples: Sequence[Example], batch_tokens: int) -> list[torch.Tensor]:
    """The target's final hidden states ``[T, H]`` (bf16, CPU) of every example."""
    out: list[torch.Tensor] = [None] * len(examples)  # type: ignore[list-item]
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    group: list[int] = []
    for i in [*order, None]:
        if i is not None and (not group or len(examples[i].ids) * (len(group) + 1) <= batch_tokens):
            group.append(i)
            continue
        ids, mask = right_padded([examples[g].ids for g in group], target.model.device)
        h = final_hidden(target.model, ids, mask)
        for row, g in enumerate(group):
            out[g] = h[row, : len(examples[g].ids)].to("cpu", torch.bfloat16)
        group = [i] if i is not None else []
    return out

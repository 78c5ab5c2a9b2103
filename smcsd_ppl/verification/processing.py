"""The processed target: logit bias, then temperature, then min-p, top-k and top-p (vLLM's order).

Each setting changes the law the engine samples: the bias reweights it, the others truncate it.
SMC-SD samples the processed law exactly: a request that sets any of them has its rows' drafted
tokens checked against it as speculative decoding checks them (``checked_retrieval``), the draft
proposing from its own law processed alike, so no particle is lost to a token outside the
target's support and every emitted token follows the processed target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import Sampling


@dataclass(frozen=True)
class RowSampling:
    """Every backend row's settings as tensors ``[R]`` (and the bias ``[R, V]``, None: none)."""

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    bias: torch.Tensor | None
    on: torch.Tensor  # [R] bool: the row's request sets any

    @classmethod
    def of(cls, settings: Sequence[Sampling | None], vocab_size: int, device) -> RowSampling:
        """The settings of rows ``0..R-1`` (None: the target unprocessed)."""
        plain = Sampling()
        rows = [s or plain for s in settings]
        bias = None
        if any(s.logit_bias for s in rows):
            bias = torch.zeros(len(rows), vocab_size)
            for r, s in enumerate(rows):
                for token, b in s.logit_bias:
                    bias[r, token] += b
            bias = bias.to(device)
        return cls(
            torch.tensor([s.top_k or vocab_size for s in rows], device=device),
            torch.tensor([s.top_p for s in rows], device=device),
            torch.tensor([s.min_p for s in rows], device=device),
            bias,
            torch.tensor([s.active for s in rows], device=device),
        )


def processed(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    rows: torch.Tensor,
    by_row: RowSampling | None,
    in_place: bool = False,
) -> torch.Tensor:
    """``logits [n, ..., V]`` of backend ``rows [n]`` at their ``temperature [n]``, processed.

    Each row's request's settings, in vLLM's order: bias, temperature, min-p, top-k, top-p (the
    tokens cut at -inf). ``by_row`` None: the temperature alone. ``in_place``: ``logits`` may be
    overwritten (a batch's logits are the largest tensor of a cycle: no second copy).
    """
    shape = (-1,) + (1,) * (logits.dim() - 1)
    if by_row is not None and by_row.bias is not None:
        logits = logits + by_row.bias[rows].view(len(rows), *([1] * (logits.dim() - 2)), -1)
    logits = logits.div_(temperature.view(shape)) if in_place else logits / temperature.view(shape)
    if by_row is None:
        return logits
    at = by_row.on[rows].nonzero(as_tuple=True)[0]  # only their rows pay for the sort
    if at.numel():
        ours = rows[at]
        logits = logits.index_copy(
            0, at, _truncated(logits[at], by_row.top_k[ours], by_row.top_p[ours], by_row.min_p[ours])
        )
    return logits


def _truncated(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Min-p, then top-k and top-p over one ascending sort (ties at the k-th value kept, as vLLM does)."""
    shape = (-1,) + (1,) * (logits.dim() - 1)
    probs = torch.softmax(logits, -1)
    logits = logits.masked_fill(probs < min_p.view(shape) * probs.amax(-1, keepdim=True), -math.inf)
    ascending, order = logits.sort(-1)
    v = logits.shape[-1]
    kth = ascending.gather(-1, (v - top_k.clamp(1, v)).view(shape).expand(*ascending.shape[:-1], 1))
    ascending = ascending.masked_fill(ascending < kth, -math.inf)
    mass = torch.softmax(ascending, -1).cumsum(-1)
    cut = mass <= 1 - top_p.view(shape)
    cut[..., -1] = False  # the likeliest always stays
    kept = ascending.masked_fill(cut, -math.inf)
    return kept.scatter(-1, order, kept)  # back in vocabulary order

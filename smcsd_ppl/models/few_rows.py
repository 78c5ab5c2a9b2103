"""Linear layers that multiply a few rows with the weight on the left, where MKL runs that faster.

``nn.Linear`` computes ``x @ W.T``. In float32 on an x86 CPU torch hands that to MKL, whose path
for one row and for 2 to about 10 streams the weight at about half the speed it reaches for the
same product written ``(W @ x.T).T`` (one row, a matrix-vector product, is doubled to two). So
decode steps and short blocks take that order; past about 10 rows the two orders are within noise
of each other and the usual one stays (docs/benchmarks.md, "Few rows on a CPU"). Both orders sum
the same products; only rounding differs.

Two settings:
- ``MAX_ROWS`` (off by default, 0; 10 turns it on) for every float32 model's layers. A request's
  steps alone would then take the few-row order and its batched steps the usual one. Even with
  the weights reading their log-probabilities exact to their own scale
  (``verification.sampling.token_log_probs``), a full run of the suite found a request alone and
  among threads apart (tests/test_sharing.py), so it stays off until a request's product order
  no longer depends on its batch-mates.
- ``backends.products.FIXED_SHAPE_MAX_ROWS`` (10) for the static path (``backends.static``),
  which calls ``products.linear`` itself. Its graphs have fixed shapes, so the order is a
  function of the shape; a shape already decides the last bits of its weights there, which hold
  alone and among batch-mates only in a fixed row bucket (``--deterministic``), past 10 rows.
"""

from __future__ import annotations

import torch
from torch import nn

from ..backends.products import MKL, left_product, takes_left

MAX_ROWS = 0  # the most rows (positions, all rows' together) that take the weight on the left


class FewRowLinear(nn.Linear):
    """``nn.Linear`` whose float32 CPU product of at most ``MAX_ROWS`` rows is ``(W @ x.T).T``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b``, in the order that is faster for its number of rows."""
        if takes_left(x, MAX_ROWS):
            return left_product(x, self.weight, self.bias)
        return super().forward(x)


def few_row_linears(model: nn.Module) -> nn.Module:
    """``model`` with its ``nn.Linear`` layers made ``FewRowLinear`` where that pays: on MKL, float32, CPU.

    The layers change class in place (their weights stay as they are), so a model sharing them
    (a layer-slice draft) gains too.
    """
    if not MKL:
        return model
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is nn.Linear and weight.is_cpu and weight.dtype == torch.float32:
            module.__class__ = FewRowLinear
    return model

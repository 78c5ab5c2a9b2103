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
- ``FIXED_SHAPE_MAX_ROWS`` (10) for the static path (``backends.static``), which calls
  ``linear`` itself. Its graphs have fixed shapes, so the order is a function of the shape; a
  shape already decides the last bits of its weights there, which hold alone and among
  batch-mates only in a fixed row bucket (``--deterministic``), whose rows are past 10.
"""

from __future__ import annotations

import torch
from torch import nn

MAX_ROWS = 0  # the most rows (positions, all rows' together) that take the weight on the left
FIXED_SHAPE_MAX_ROWS = 10  # the same for the static path
MKL = torch.backends.mkl.is_available()  # the order pays on MKL's products only


def takes_left(x: torch.Tensor, max_rows: int) -> bool:
    """Whether ``x`` takes the weight on the left: at most ``max_rows`` float32 CPU rows, on MKL."""
    rows = x.numel() // max(1, x.shape[-1])
    return 1 <= rows <= max_rows and x.is_cpu and x.dtype == torch.float32 and MKL


def left_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` computed as ``(W @ x.T).T``: the same products, summed in another order."""
    rows = x.numel() // max(1, x.shape[-1])
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:  # one row is a matrix-vector product, the slow path: two make a matrix
        flat = torch.cat([flat, flat])
    out = torch.mm(weight, flat.T).T[:rows]
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, with the weight on the left where ``takes_left(x, FIXED_SHAPE_MAX_ROWS)``."""
    return left_product(x, layer.weight, layer.bias) if takes_left(x, FIXED_SHAPE_MAX_ROWS) else layer(x)


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

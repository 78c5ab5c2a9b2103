"""Products of a few rows with the weight on the left, where MKL runs that faster.

``x @ W.T`` (what ``nn.Linear`` computes) in float32 on an x86 CPU goes to MKL, whose path for 1
to about 10 rows streams the weight at about half the speed it reaches for the same product
written ``(W @ x.T).T``. Both orders sum the same products; only rounding differs. The static
path (``backends.static``) takes that order by its graphs' shapes (``linear``); the eager
engine's layers take it only where ``models.few_rows.MAX_ROWS`` says (off by default: there the
order would change with a request's batch-mates).
"""

from __future__ import annotations

import torch
from torch import nn

FIXED_SHAPE_MAX_ROWS = 10  # the static path's: the most rows (positions, all rows' together) on the left
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

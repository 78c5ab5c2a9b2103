"""Products of a few rows with the weight on the left, where MKL runs that faster.

``x @ W.T`` (what ``nn.Linear`` computes) in float32 on an x86 CPU goes to MKL, whose path for 1
to about 10 rows streams the weight at about half the speed it reaches for the same product
written ``(W @ x.T).T``. Both orders sum the same products; only rounding differs. Our forward
(``backends.llama``) takes that order by its feed's shape (``llama.FEW`` positions or fewer);
the model's own forward, the reference, keeps the usual one.
"""

from __future__ import annotations

import torch

MKL = torch.backends.mkl.is_available()  # the order pays on MKL's products only


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

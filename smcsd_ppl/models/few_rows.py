"""Linear layers that multiply a few rows with the weight on the left, where MKL runs that faster.

``nn.Linear`` computes ``x @ W.T``. In float32 on an x86 CPU torch hands that to MKL, whose path
for one row and for 2 to about 10 streams the weight at about half the speed it reaches for the
same product written ``(W @ x.T).T`` (one row, a matrix-vector product, is doubled to two). So
decode steps and short blocks take that order; past about 10 rows the two orders are within noise
of each other and the usual one stays (docs/benchmarks.md, "Few rows on a CPU"). Both orders sum
the same products; only rounding differs.

Off by default (``MAX_ROWS = 0``; set it to 10 to turn it on): a request's steps alone then
take the few-row order and its batched steps the usual one. Even with the weights reading their
log-probabilities exact to their own scale (``verification.sampling.token_log_probs``), a full
run of the suite found a request alone and among threads apart (tests/test_sharing.py), so it
stays off until a request's product order no longer depends on its batch-mates.
"""

from __future__ import annotations

import torch
from torch import nn

MAX_ROWS = 0  # the most rows (positions, all rows' together) that take the weight on the left


class FewRowLinear(nn.Linear):
    """``nn.Linear`` whose float32 CPU product of at most ``MAX_ROWS`` rows is ``(W @ x.T).T``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b``, in the order that is faster for its number of rows."""
        rows = x.numel() // max(1, x.shape[-1])
        if not (1 <= rows <= MAX_ROWS and x.is_cpu and x.dtype == torch.float32):
            return super().forward(x)
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1:  # one row is a matrix-vector product, the slow path: two make a matrix
            flat = torch.cat([flat, flat])
        out = torch.mm(self.weight, flat.T).T[:rows]
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().view(*x.shape[:-1], self.out_features)


def few_row_linears(model: nn.Module) -> nn.Module:
    """``model`` with its ``nn.Linear`` layers made ``FewRowLinear`` where that pays: on MKL, float32, CPU.

    The layers change class in place (their weights stay as they are), so a model sharing them
    (a layer-slice draft) gains too.
    """
    if not torch.backends.mkl.is_available():
        return model
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is nn.Linear and weight.is_cpu and weight.dtype == torch.float32:
            module.__class__ = FewRowLinear
    return model

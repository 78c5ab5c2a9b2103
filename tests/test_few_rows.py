"""Few-row products: our forward's products of a few positions take the weight on the left.

On MKL a float32 product of 1 to about 10 rows runs faster as ``(W @ x.T).T``; our forward
(``backends.llama``) takes that order by its feed's shape, where ``cpu.CPUTricks.few_rows`` is
on. The model's own forward, the reference, keeps ``nn.Linear``'s order.
"""

from __future__ import annotations

import pytest
import torch

from smcsd_ppl.backends import products
from smcsd_ppl.backends.hf import HFBatchedLM
from smcsd_ppl.backends.llama import FEW, LlamaForward

needs_mkl = pytest.mark.skipif(not products.MKL, reason="the order is taken on MKL builds only")


@pytest.mark.parametrize("rows", [1, 2, 7, 10, 11])
@pytest.mark.parametrize("bias", [False, True])
def test_the_left_product_computes_what_linear_computes(rows, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(rows, 3, 24)[:, 0]  # not contiguous
    got = products.left_product(x, layer.weight, layer.bias)
    assert got.shape == (rows, 40) and got.is_contiguous()
    torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)


def _per_layer_products(lm, rows: int, t: int, mm_calls) -> int:
    lm.prefill([[5, 6, 7 + r] for r in range(rows)])  # no twins: each row computes
    mm_calls.clear()
    lm.extend(torch.full((rows, t), 9))
    return len(mm_calls)


@needs_mkl
def test_our_forward_takes_the_weight_on_the_left_up_to_few_positions(tiny_llama, mm_calls):
    """Seven products a layer and the head, with the weight on the left, exactly where it has few rows."""
    layers = len(tiny_llama.model.layers)
    ours = HFBatchedLM(tiny_llama, compiled=LlamaForward(tiny_llama))
    assert _per_layer_products(ours, 1, 1, mm_calls) == 7 * layers + 1
    assert all(shape[0] != 1 for shape in mm_calls)  # weights [out, in], never a one-row operand
    assert _per_layer_products(ours, 2, FEW // 2, mm_calls) == 7 * layers + 1
    assert _per_layer_products(ours, 2, FEW // 2 + 1, mm_calls) == 0  # past FEW: the usual order


@needs_mkl
def test_the_trick_off_and_the_reference_keep_the_usual_order(tiny_llama, mm_calls):
    off = HFBatchedLM(tiny_llama, compiled=LlamaForward(tiny_llama, few_rows=False))
    reference = HFBatchedLM(tiny_llama)
    assert _per_layer_products(off, 1, 1, mm_calls) == 0
    assert _per_layer_products(reference, 1, 1, mm_calls) == 0


def test_either_order_gives_the_model_s_logits(tiny_llama):
    prompts = [[5, 6, 7, 8], [9, 10]]
    block = torch.tensor([[11, 12], [13, 14]])
    out = []
    for few in (True, False):
        lm = HFBatchedLM(tiny_llama, compiled=LlamaForward(tiny_llama, few_rows=few))
        lm.prefill(prompts)
        out.append(lm.extend(block))
    reference = HFBatchedLM(tiny_llama)
    reference.prefill(prompts)
    torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[0], reference.extend(block), rtol=1e-4, atol=1e-4)

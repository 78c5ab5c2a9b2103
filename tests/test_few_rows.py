"""Few-row linear layers: the same products as ``nn.Linear``, swapped in only where they pay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from smcsd_ppl.backends import products
from smcsd_ppl.models import few_rows
from smcsd_ppl.models.few_rows import FewRowLinear, few_row_linears

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="the swap is for MKL builds")


def _pair(bias: bool, dtype: torch.dtype = torch.float32) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    usual = nn.Linear(24, 40, bias=bias).to(dtype)
    few = nn.Linear(24, 40, bias=bias).to(dtype)
    few.load_state_dict(usual.state_dict())
    few.__class__ = FewRowLinear
    return usual, few


SHAPES = [(1, 24), (2, 24), (7, 24), (10, 24), (11, 24), (1, 1, 24), (2, 3, 24), (3, 4, 24)]  # rows: 1-12


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_few_row_linear_computes_what_linear_computes(shape, bias, monkeypatch):
    monkeypatch.setattr(few_rows, "MAX_ROWS", 10)
    usual, few = _pair(bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        expected, got = usual(x), few(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_few_row_order_is_the_one_taken_up_to_max_rows(monkeypatch, mm_calls):
    """Up to ``MAX_ROWS`` rows the product is ``W @ x.T``; past it, in bf16, or off (0), the usual one."""
    usual, few = _pair(bias=False)
    with torch.inference_mode():
        few(torch.randn(1, 24))  # off by default
        monkeypatch.setattr(few_rows, "MAX_ROWS", 10)
        few(torch.randn(1, 24))
        few(torch.randn(10, 24))
        few(torch.randn(11, 24))
        few.to(torch.bfloat16)(torch.randn(2, 24, dtype=torch.bfloat16))
    assert mm_calls == [few.weight.shape, few.weight.shape]


@needs_mkl
def test_the_static_paths_linear_takes_the_few_row_order_by_shape_alone(mm_calls):
    """``linear`` (the static path's) puts the weight on the left up to 10 rows, whatever ``MAX_ROWS``."""
    usual, _ = _pair(bias=True)
    with torch.inference_mode():
        for shape in [(1, 24), (2, 5, 24), (11, 24)]:
            x = torch.randn(shape)
            torch.testing.assert_close(products.linear(usual, x), usual(x), rtol=1e-5, atol=1e-5)
    assert few_rows.MAX_ROWS == 0 and mm_calls == [usual.weight.shape, usual.weight.shape]


@needs_mkl
def test_only_float32_cpu_linears_change_class_and_keep_their_weights():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.LayerNorm(4))
    weight = model[0].weight
    few_row_linears(model)
    assert [type(m) for m in model] == [FewRowLinear, nn.Linear, nn.LayerNorm]
    assert model[0].weight is weight


@needs_mkl
@pytest.mark.slow
def test_the_embedded_pair_in_float32_gets_the_same_logits_either_way(default_smcsd_f32, monkeypatch):
    model = default_smcsd_f32.target.model
    assert all(type(m) is FewRowLinear for m in model.modules() if isinstance(m, nn.Linear))
    ids = torch.tensor([default_smcsd_f32.encode("The capital of France is")])
    monkeypatch.setattr(few_rows, "MAX_ROWS", 10)
    with torch.inference_mode():
        few = model(input_ids=ids[:, -3:]).logits  # 3 rows: the few-row order
        one = model(input_ids=ids[:, -1:]).logits  # 1 row, doubled
        monkeypatch.setattr(few_rows, "MAX_ROWS", 0)
        usual, usual_one = model(input_ids=ids[:, -3:]).logits, model(input_ids=ids[:, -1:]).logits
    torch.testing.assert_close(few, usual, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(one, usual_one, rtol=1e-4, atol=1e-3)

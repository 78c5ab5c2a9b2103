"""A flattened feed (``backends.ragged``) leaves every other forward of the model as SDPA computes it.

Its own exactness (each row's logits and cache against a plain forward of the row's sequence)
is checked where feeds are: ``test_backend.py`` and ``test_twins.py``.
"""

from __future__ import annotations

import copy

import tiny
import torch

from smcsd_ppl.backends import ragged
from smcsd_ppl.backends.hf import HFBatchedLM


def padded_batch_logits(model) -> torch.Tensor:
    """Two left-padded prompts through the model's own masks, as ``generate`` runs them."""
    ids = torch.tensor([[0, 0, 5, 17, 33], [40, 41, 42, 43, 44]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).logits


def test_a_flattened_model_runs_every_other_forward_as_sdpa():
    model = tiny.llama(seed=3, layers=2)
    layer = model.model.layers[1].self_attn
    layer.config = copy.deepcopy(layer.config)  # a layer of its own config, as the distilled draft's
    before = padded_batch_logits(model)
    greedy = model.generate(torch.tensor([[5, 17, 33]]), max_new_tokens=6, do_sample=False)
    assert HFBatchedLM(model).flattens
    assert {m.config._attn_implementation for m in model.modules() if hasattr(m, "config")} == {ragged.NAME}
    assert torch.equal(padded_batch_logits(model), before)
    assert torch.equal(model.generate(torch.tensor([[5, 17, 33]]), max_new_tokens=6, do_sample=False), greedy)


def test_a_model_with_other_attention_keeps_it_and_runs_a_forward_per_count():
    model = tiny.llama(seed=3, layers=2)
    model.config._attn_implementation = "eager"
    lm = HFBatchedLM(model)
    assert not lm.flattens and model.config._attn_implementation == "eager"
    lm.row_position_cost = 1.0  # dear positions: rows fed 3 and 1 run apart
    lm.prefill([[5, 17, 33], [40, 41]])
    before = lm.stats.passes
    lm.extend(torch.tensor([[7, 8, 9], [0, 0, 10]]), torch.tensor([[True] * 3, [False, False, True]]))
    assert lm.stats.passes == before + 2


def test_only_fed_rows_of_unlike_counts_make_a_flat_group():
    valid = torch.tensor([[False, True, True], [False, False, False], [False, False, True]])
    [(width, rows)] = ragged.flat_group(valid)
    assert width == 2 and rows.tolist() == [0, 2]
    assert ragged.flat_group(torch.tensor([[False, True], [False, False], [False, True]])) is None  # alike
    assert ragged.flat_group(torch.zeros(2, 3, dtype=torch.bool)) is None  # nobody fed

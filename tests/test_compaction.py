"""Rows that reject different amounts (batched exact SD) keep exact logits in bounded memory."""

from __future__ import annotations

import torch
from helpers import scratch_logits
from tiny import llama

from smcsd_ppl.backends.hf import HFBatchedLM
from smcsd_ppl.backends.mock import MockLM


def test_hf_uneven_rejections_keep_logits_and_reuse_the_cache():
    model = llama(seed=3, layers=2)
    lm = HFBatchedLM(model)
    seqs = [[5, 6, 7], [9]]
    lm.prefill(seqs)
    capacity = lm.cache.capacity
    g = torch.Generator().manual_seed(0)
    for _ in range(10):  # each cycle: 4 new tokens, row 0 keeps 1, row 1 keeps 3
        block = torch.randint(1, 300, (2, 4), generator=g)
        lm.extend(block)
        lm.drop_tail(torch.tensor([3, 1]))
        seqs[0] += block[0, :1].tolist()
        seqs[1] += block[1, :3].tolist()
    assert lm.cache.capacity == capacity  # columns are reused, not 10 x 4 new ones
    nxt = torch.tensor([[11], [12]])
    out = lm.extend(nxt)[:, -1]
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(
            out[row], scratch_logits(model, seq + [int(nxt[row])]), atol=1e-4, rtol=1e-4
        )


def test_mock_compaction_keeps_logits():
    lm = MockLM(6, order=3)
    seqs = [[1, 2], [3]]
    lm.prefill(seqs)
    for _ in range(12):
        lm.extend(torch.tensor([[1, 2, 3], [2, 3, 4]]))
        lm.drop_tail(torch.tensor([3, 1]))
        seqs[1] += [2, 3]
    out = lm.extend(torch.tensor([[5], [5]]))[:, -1]
    assert lm.rows.length < 40
    assert torch.equal(out[0], lm.next_logits(seqs[0] + [5]))
    assert torch.equal(out[1], lm.next_logits(seqs[1] + [5]))

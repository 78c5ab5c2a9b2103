"""The row store scores a block only as far as its verification can reach, and commits what it read."""

from __future__ import annotations

import torch
from helpers import mock_pair

from smcsd_ppl.inference.rows import RowStore

BLOCKS = [[1, 2, 0], [2, 1, 2], [0, 0, 1]]  # the batch's block length k = 3


def scored(read):
    """A store of three rows with a token queued, its blocks scored (``read``: how far each is read)."""
    store = RowStore(*mock_pair())
    store.start([[1, 2], [3], [2, 2, 1]], [0, 1, 2], draft=False)
    store.queue({0: [1], 1: [0], 2: [2]})
    logits, _ = store.score([0, 1, 2], torch.tensor(BLOCKS), read)
    return store, logits


def test_a_block_read_up_to_its_limit_scores_and_commits_as_one_read_whole():
    whole, full = scored(None)
    part, read = scored([1, 3, 0])
    for i, n in enumerate([1, 3, 0]):
        torch.testing.assert_close(read[i, : n + 1], full[i, : n + 1])  # the positions verification reads
    kept, nexts = [1, 2, 0], [0, 1, 2]
    for store in (whole, part):
        store.commit([0, 1, 2], BLOCKS, kept, nexts, [0, 0, 0])
    # Both hold each row's prompt, its kept tokens and the queued bonus: the same next logits.
    torch.testing.assert_close(part.next_logits([0, 1, 2]), whole.next_logits([0, 1, 2]))

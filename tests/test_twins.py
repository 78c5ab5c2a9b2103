"""Rows holding the same tokens compute once (``backends.twins``), and every row stays its own sequence.

Each step checks every row's logits against a plain forward of that row's whole sequence, so
a twin that took the wrong row's logits or cache columns (or none) fails here; the counted
positions check that twins were not computed.
"""

from __future__ import annotations

import pytest
import torch
from helpers import scratch_logits

from smcsd_ppl.backends.hf import HFBatchedLM

ATOL, RTOL = 1e-4, 1e-4


def extend(lm, model, seqs, feed):
    """Feed each row its tokens (a left-padded block); the positions the backend computed."""
    width = max(map(len, feed))
    tokens = torch.tensor([[0] * (width - len(f)) + f for f in feed])
    valid = torch.tensor([[False] * (width - len(f)) + [True] * len(f) for f in feed])
    before = lm.stats.tokens
    logits = lm.extend(tokens, valid)
    for s, f in zip(seqs, feed):
        s += f
    for r, (s, f) in enumerate(zip(seqs, feed)):
        if f:
            torch.testing.assert_close(
                logits[r, -len(f) :], scratch_logits(model, s, len(f)), atol=ATOL, rtol=RTOL
            )
    assert lm.contents.held == [tuple(s) for s in seqs]
    return lm.stats.tokens - before


@pytest.mark.parametrize("flattens", [True, False])
def test_twins_compute_once_and_every_row_reads_its_own_sequence(tiny_llama, flattens):
    lm = HFBatchedLM(tiny_llama)
    lm.flattens = flattens  # flattened: real tokens alone (backends.ragged); else a forward per count
    lm.prefill([[5, 17, 33, 2], [40, 41]])
    lm.fork(torch.tensor([0, 0, 1, 0]))  # a request's particles: rows 0, 1 and 3 hold one prompt
    seqs = [[5, 17, 33, 2], [5, 17, 33, 2], [40, 41], [5, 17, 33, 2]]
    assert extend(lm, tiny_llama, seqs, [[4, 5], [4, 5], [6, 7], [4, 5]]) == 2 * 2  # one of three runs
    assert extend(lm, tiny_llama, seqs, [[8], [9], [8], [8]]) == 3  # row 1 leaves its twins
    lm.fork(torch.tensor([2, 1, 1, 0]))  # a resampling: rows 1 and 2 are copies of row 1
    seqs = [list(seqs[2]), list(seqs[1]), list(seqs[1]), list(seqs[0])]
    # Twins fed fewer tokens than the padded width: one forward, rows 1 and 2 computed once.
    assert extend(lm, tiny_llama, seqs, [[3, 1], [7], [7], [3, 1]]) == (2 + 1 + 2 if flattens else 3 * 2)
    lm.row_position_cost = 2.0  # dear rows: unflattened, a forward per length (apart 22, padded 25)
    assert extend(lm, tiny_llama, seqs, [[2, 3, 1], [2, 3, 1], [2, 3, 1], [2]]) == 2 * 3 + 1
    lm.drop_tail(torch.tensor([0, 1, 0, 0]))  # row 1 loses a token: no longer row 2's twin
    del seqs[1][-1]
    assert extend(lm, tiny_llama, seqs, [[6], [6], [6], []]) == 3


def test_without_twins_every_row_runs(tiny_llama):
    lm = HFBatchedLM(tiny_llama)
    lm.shares_twins = False  # as on an accelerator, where reading the fed tokens would sync
    lm.prefill([[5, 17, 33, 2]])
    lm.fork(torch.tensor([0, 0, 0]))
    seqs = [[5, 17, 33, 2] for _ in range(3)]
    tokens = torch.tensor([[4, 5]] * 3)
    before = lm.stats.tokens
    logits = lm.extend(tokens, torch.ones_like(tokens, dtype=torch.bool))
    assert lm.stats.tokens - before == 3 * 2
    for r in range(3):
        torch.testing.assert_close(
            logits[r], scratch_logits(tiny_llama, seqs[r] + [4, 5], 2), atol=ATOL, rtol=RTOL
        )


def read_tree(lm, model, seqs, trees):
    """Read a tree per row (its tokens and parents), each node against its path; the positions computed."""
    width = max(len(t) for t, _ in trees)
    tokens = torch.tensor([t + [0] * (width - len(t)) for t, _ in trees])
    parents = torch.tensor([p + [-1] * (width - len(p)) for _, p in trees])
    valid = torch.tensor([[True] * len(t) + [False] * (width - len(t)) for t, _ in trees])
    before = lm.stats.tokens
    logits = lm.extend_tree(tokens, parents, valid)
    for r, (nodes, ups) in enumerate(trees):
        for j in range(len(nodes)):
            path, k = [], j
            while k >= 0:
                path.insert(0, nodes[k])
                k = ups[k]
            want = scratch_logits(model, seqs[r] + path)
            torch.testing.assert_close(logits[r, j], want, atol=ATOL, rtol=RTOL)
    return lm.stats.tokens - before


def test_a_tree_read_computes_twins_once_and_leaves_out_rows_with_no_node(tiny_llama):
    lm = HFBatchedLM(tiny_llama)
    lm.prefill([[5, 17, 33, 2], [40, 41]])
    lm.fork(torch.tensor([0, 0, 1, 0]))
    seqs = [[5, 17, 33, 2], [5, 17, 33, 2], [40, 41], [5, 17, 33, 2]]
    trees = [([7, 8, 9], [-1, 0, 0]), ([7, 8, 9], [-1, 0, 0]), ([], []), ([7, 8], [-1, 0])]
    # row 1 is row 0's twin and row 2 reads nothing: one forward of rows 0 and 3, 6 of 12 positions
    assert read_tree(lm, tiny_llama, seqs, trees) == 2 * 3
    lm.keep_path(torch.tensor([[1, 0, 1], [1, 0, 1], [0, 0, 0], [1, 1, 0]]).bool())
    seqs = [seqs[0] + [7, 9], seqs[1] + [7, 9], seqs[2], seqs[3] + [7, 8]]
    # what each row kept is known, so rows 0 and 1 stay twins (row 1's kept columns are row 0's)
    assert extend(lm, tiny_llama, seqs, [[4], [4], [4], [4]]) == 3
    assert extend(lm, tiny_llama, seqs, [[6], [8], [6], [6]]) == 4  # row 1 reads its own columns now

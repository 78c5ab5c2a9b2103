"""HFBatchedLM against from-scratch forwards of a tiny random Llama.

Holes (left padding, masked tokens, dropped tails) must be invisible: every logit
the backend returns equals the logit of a plain forward over the row's real tokens.
The shipped ``BatchedLMContract`` (run in test_contracts.py against plain forwards)
checks fused == stepwise, forks and dropped tails; this file checks the rest: the
cache's reuse and growth, budgets, bounds, errors and dtypes.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import scratch_logits
from tiny import MAX_POSITIONS, llama

from smcsd_ppl import SMCConfig
from smcsd_ppl.backends import hf, kv
from smcsd_ppl.backends.base import CacheExhausted, NonFiniteLogits, length_groups
from smcsd_ppl.backends.hf import HFBatchedLM

ATOL, RTOL = 1e-4, 1e-4
PROMPTS = [[5, 17, 33, 2, 250, 9, 11], [40, 41], [7, 8, 99, 100, 101], [3]]


def block(rows, k, seed=0):
    return torch.randint(1, 300, (rows, k), generator=torch.Generator().manual_seed(seed))


def test_prefill_equals_scratch_for_left_padded_prompts(tiny_llama):
    lm = HFBatchedLM(tiny_llama)
    logits = lm.prefill(PROMPTS)
    assert logits.shape == (len(PROMPTS), lm.vocab_size) and logits.dtype == torch.float32
    for i, p in enumerate(PROMPTS):
        torch.testing.assert_close(logits[i], scratch_logits(tiny_llama, p, 1)[0], atol=ATOL, rtol=RTOL)
    assert lm.stats.calls == 1  # short prompts: the padding costs less than another forward


def test_prompts_of_unlike_lengths_prefill_in_groups_each_row_on_its_own_prompt(tiny_llama):
    # 100 and 70 tokens share a forward, 2 and 1 another; every row then reads its own cache.
    prompts = [list(range(3, 103)), [40, 41], list(range(5, 75)), [3]]
    assert length_groups([len(p) for p in prompts]) == [[0, 2], [1, 3]]
    assert length_groups([100, 40, 60]) == [[0, 2, 1]]  # 60 pads 40 positions: within the slack
    lm = HFBatchedLM(tiny_llama)
    logits = lm.prefill(prompts)
    nxt = lm.extend(torch.tensor([[60], [61], [62], [63]]))[:, -1]
    assert lm.stats.calls == 3
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i], scratch_logits(tiny_llama, p), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(nxt[i], scratch_logits(tiny_llama, [*p, 60 + i]), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("flattens", "row_cost", "passes", "positions"),
    [(True, 1.0, 1, 4), (True, 0.05, 1, 4), (False, 1.0, 2, 4), (False, 0.05, 1, 6)],
)
def test_a_left_padded_feed_of_unlike_lengths_runs_its_real_tokens_alone(
    tiny_llama, flattens, row_cost, passes, positions
):
    # Rows feeding 0, 3 and 1 real tokens (the first asks nothing): each reads its own cache,
    # the next forward sees every row's real tokens only, and the backend counts one call.
    # Flattened (backends.ragged), the 4 real tokens run in one forward whatever rows cost.
    # A model that cannot: a forward costs 1 and row_cost per row-position, apart 2 + 4 r,
    # padded together 1 + 6 r.
    lm = HFBatchedLM(tiny_llama)
    assert lm.flattens  # SDPA through the attention interface, on a CPU
    lm.flattens, lm.row_position_cost = flattens, row_cost
    lm.prefill(PROMPTS[:3])
    feeds = [[], [7, 8, 9], [10]]
    tokens = torch.tensor([[0] * (3 - len(f)) + f for f in feeds])
    valid = torch.tensor([[False] * (3 - len(f)) + [True] * len(f) for f in feeds])
    calls, before, computed = lm.stats.calls, lm.stats.passes, lm.stats.tokens
    out = lm.extend(tokens, valid)
    assert lm.stats.calls == calls + 1 and lm.stats.passes == before + passes
    assert lm.stats.tokens == computed + positions
    assert lm.bound == [len(p) + len(f) for p, f in zip(PROMPTS, feeds)]
    for r, f in enumerate(feeds[1:], 1):
        want = scratch_logits(tiny_llama, PROMPTS[r] + f, len(f))
        torch.testing.assert_close(out[r, 3 - len(f) :], want, atol=ATOL, rtol=RTOL)
    nxt = lm.extend(torch.tensor([[11], [12], [13]]))[:, -1]
    for r, f in enumerate(feeds):
        seq = PROMPTS[r] + f + [11 + r]
        torch.testing.assert_close(nxt[r], scratch_logits(tiny_llama, seq), atol=ATOL, rtol=RTOL)


def test_fork_that_moves_few_rows_copies_in_place(tiny_llama):
    # Resampling that replaces 1 of 4 rows takes the in-place path; logits must not change.
    lm = HFBatchedLM(tiny_llama)
    lm.prefill(PROMPTS)
    first = block(len(PROMPTS), 3, seed=3)
    lm.extend(first)
    rows = torch.tensor([0, 1, 0, 3])
    lm.fork(rows)
    more = block(4, 2, seed=4)
    out = lm.extend(more)
    for i, r in enumerate(rows.tolist()):
        seq = PROMPTS[r] + first[r].tolist() + more[i].tolist()
        torch.testing.assert_close(out[i], scratch_logits(tiny_llama, seq, 2), atol=ATOL, rtol=RTOL)


def test_rows_leaving_keep_the_buffers_and_each_staying_row_its_sequence(tiny_llama):
    lm = HFBatchedLM(tiny_llama)
    lm.prefill(PROMPTS)
    first = block(len(PROMPTS), 2, seed=5)
    lm.extend(first)
    buffer = lm.cache.layers[0].keys.untyped_storage().data_ptr()
    rows = torch.tensor([0, 2, 3])  # the second request leaves: the rows after it move up
    lm.fork(rows)
    assert lm.cache.layers[0].keys.untyped_storage().data_ptr() == buffer  # no new buffer to zero
    more = block(3, 2, seed=6)
    out = lm.extend(more)
    for i, r in enumerate(rows.tolist()):
        seq = PROMPTS[r] + first[r].tolist() + more[i].tolist()
        torch.testing.assert_close(out[i], scratch_logits(tiny_llama, seq, 2), atol=ATOL, rtol=RTOL)


def test_fork_to_fewer_rows_crops_padding_columns(tiny_llama):
    lm = HFBatchedLM(tiny_llama)
    lm.prefill([[1, 2, 3, 4, 5, 6], [7, 8]])
    lm.fork(torch.tensor([1]))  # only the short row survives: its left padding is leading, not trailing
    out = lm.extend(torch.tensor([[9, 10]]))
    torch.testing.assert_close(out[0], scratch_logits(tiny_llama, [7, 8, 9, 10], 2), atol=ATOL, rtol=RTOL)


def test_holes_inside_a_block_are_invisible(tiny_llama):
    lm = HFBatchedLM(tiny_llama)
    lm.prefill(PROMPTS)
    tokens = block(len(PROMPTS), 4, seed=3)
    valid = torch.tensor(
        [
            [True, False, True, True],
            [False, True, False, True],
            [True, True, True, True],
            [False, False, True, True],
        ]
    )
    out = lm.extend(tokens, valid)
    more = block(len(PROMPTS), 2, seed=4)
    nxt = lm.extend(more)
    for i, p in enumerate(PROMPTS):
        real = tokens[i][valid[i]].tolist()
        # logits at each real position see only the real tokens before it
        ref = scratch_logits(tiny_llama, p + real, len(real))
        torch.testing.assert_close(out[i][valid[i]], ref, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(
            nxt[i], scratch_logits(tiny_llama, p + real + more[i].tolist(), 2), atol=ATOL, rtol=RTOL
        )
    assert lm.lengths.tolist() == [len(p) + int(v.sum()) + 2 for p, v in zip(PROMPTS, valid)]


def test_drop_tail_rewinds_the_write_position_without_copies(tiny_llama, monkeypatch):
    # Many cycles of extend + drop_tail reuse the same columns: the cache never grows or moves.
    monkeypatch.setattr(hf, "HEADROOM", 64)  # room for every column the cycles keep
    lm = HFBatchedLM(tiny_llama)
    lm.prefill(PROMPTS)
    capacity, ptr = lm.cache.capacity, lm.cache.layers[0].keys.data_ptr()
    seqs = [list(p) for p in PROMPTS]
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        tokens = torch.randint(1, 300, (len(PROMPTS), 5), generator=g)
        lm.extend(tokens)
        keep = [1, 3, 0, 5]
        lm.drop_tail(torch.tensor([5 - k for k in keep]))
        for s, row, k in zip(seqs, tokens.tolist(), keep):
            s += row[:k]
    assert lm.lengths.tolist() == [len(s) for s in seqs] == lm.bound
    assert lm.cache.capacity == capacity and lm.cache.layers[0].keys.data_ptr() == ptr
    out = lm.extend(torch.tensor([[3], [4], [5], [6]]))
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i], scratch_logits(tiny_llama, s + [3 + i], 1), atol=ATOL, rtol=RTOL)


def test_capacity_doubles_when_a_forward_needs_more(tiny_llama, monkeypatch):
    monkeypatch.setattr(hf, "HEADROOM", 2)
    lm = HFBatchedLM(tiny_llama)
    lm.prefill(PROMPTS)
    first = lm.cache.capacity
    assert first == max(len(p) for p in PROMPTS) + 2
    tokens = block(len(PROMPTS), 4, seed=12)
    out = lm.extend(tokens)
    assert lm.cache.capacity == 2 * first
    for i, p in enumerate(PROMPTS):
        torch.testing.assert_close(
            out[i], scratch_logits(tiny_llama, p + tokens[i].tolist(), 4), atol=ATOL, rtol=RTOL
        )


def test_mostly_hole_blocks_leave_no_holes_behind(tiny_llama):
    # Holes are written past each row's end and overwritten next time: forks and later
    # forwards see only real tokens, and the row lengths count real tokens only.
    lm = HFBatchedLM(tiny_llama)
    lm.prefill(PROMPTS)
    t = 40
    tokens = block(len(PROMPTS), t, seed=10)
    valid = torch.zeros(len(PROMPTS), t, dtype=torch.bool)
    keep = {0: [3, 39], 1: [0, 1, 2, 20], 2: [38], 3: [10, 11, 30, 39]}
    for r, cols in keep.items():
        valid[r, cols] = True
    lm.extend(tokens, valid)
    rows = torch.tensor([3, 1, 1, 0, 2])
    lm.fork(rows)
    real = [PROMPTS[r] + tokens[r][valid[r]].tolist() for r in range(len(PROMPTS))]
    assert lm.lengths.tolist() == [len(real[r]) for r in rows.tolist()] == lm.bound
    more = block(len(rows), 3, seed=11)
    holes = torch.tensor([[True, False, True]] * len(rows))
    out = lm.extend(more, holes)
    for i, r in enumerate(rows.tolist()):
        seq = real[r] + more[i][holes[i]].tolist()
        torch.testing.assert_close(out[i][holes[i]], scratch_logits(tiny_llama, seq, 2), atol=ATOL, rtol=RTOL)


def test_a_dropped_backend_frees_its_cache_without_the_garbage_collector(tiny_llama):
    # A cycle through the cache (a layer pointing back at it) keeps every call's KV buffers
    # until a full collection, dozens of calls later: the process's memory climbs meanwhile.
    lm = HFBatchedLM(tiny_llama)
    lm.prefill(PROMPTS)
    keys = weakref.ref(lm.cache.layers[0].keys)
    gc.disable()
    try:
        del lm
        assert keys() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("method", ["smcsd", "ar", "sd", "hf_prompt_lookup", "racer_sampling"])
def test_no_call_leaves_tensors_to_the_garbage_collector(tiny_smcsd, method):
    config = SMCConfig(max_new_tokens=8, seed=0)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        tiny_smcsd.generate("hello there", method=method, config=config)
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not cyclic, f"{len(cyclic)} tensors freed only by the garbage collector"


def test_drop_more_than_held_raises(tiny_llama):
    lm = HFBatchedLM(tiny_llama)
    lm.prefill([[1, 2], [3, 4, 5]])
    with pytest.raises(ValueError, match="cannot drop"):
        lm.drop_tail(torch.tensor([3, 0]))


def test_kv_budget_raises_before_the_forward(tiny_llama):
    lm = HFBatchedLM(tiny_llama, max_cache_bytes=lm_bytes(tiny_llama, rows=2, positions=8), name="target")
    lm.prefill([[1, 2, 3], [4, 5, 6, 7]])
    calls = lm.stats.calls
    with pytest.raises(CacheExhausted, match="budget") as err:
        lm.extend(torch.ones(2, 8, dtype=torch.long))
    assert "max_cache_bytes" in str(err.value) and "target" in str(err.value)
    assert lm.stats.calls == calls  # refused before running the tiny_llama
    with pytest.raises(CacheExhausted, match="budget"):
        HFBatchedLM(tiny_llama, max_cache_bytes=1).prefill([[1, 2]])


def test_fork_to_more_rows_stays_within_the_budget(tiny_llama):
    budget = lm_bytes(tiny_llama, rows=2, positions=8)
    lm = HFBatchedLM(tiny_llama, max_cache_bytes=budget)
    lm.prefill([[1, 2, 3]])
    for rows in (2, 4):
        lm.fork(torch.zeros(rows, dtype=torch.long))
        assert lm.bytes_per_token * rows * lm.cache.capacity <= budget
    out = lm.extend(torch.tensor([[4]] * 4))
    torch.testing.assert_close(out[3], scratch_logits(tiny_llama, [1, 2, 3, 4], 1), atol=ATOL, rtol=RTOL)
    with pytest.raises(CacheExhausted, match="budget"):
        lm.fork(torch.zeros(8, dtype=torch.long))  # 8 rows x 4 positions > 2 x 8


def lm_bytes(tiny_llama, rows, positions):
    return HFBatchedLM(tiny_llama).bytes_per_token * rows * positions


def test_context_limit_raises(tiny_llama):
    lm = HFBatchedLM(tiny_llama)
    assert lm.max_length == MAX_POSITIONS
    with pytest.raises(ValueError, match="context"):
        lm.prefill([[1] * (MAX_POSITIONS + 5)])
    with pytest.raises(ValueError, match="context"):
        lm.prefill([[1, 2], [1] * MAX_POSITIONS])  # exactly the context leaves no room to generate
    lm.prefill([[1] * (MAX_POSITIONS - 3)])
    with pytest.raises(ValueError, match="context"):
        lm.extend(torch.ones(1, 4, dtype=torch.long))


def test_empty_prompts_raise(tiny_llama):
    lm = HFBatchedLM(tiny_llama)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        lm.prefill([[1, 2], []])
    with pytest.raises(ValueError, match="no prompts"):
        lm.prefill([])
    with pytest.raises(ValueError, match="before prefill"):
        HFBatchedLM(tiny_llama).extend(torch.ones(1, 1, dtype=torch.long))


def test_bad_extend_shape_raises(tiny_llama):
    lm = HFBatchedLM(tiny_llama)
    lm.prefill([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"\[2, T\]"):
        lm.extend(torch.ones(3, 1, dtype=torch.long))


def test_nan_logits_raise_at_the_next_check():
    broken = llama(seed=0)
    broken.lm_head.weight.fill_(float("nan"))
    lm = HFBatchedLM(broken, name="target")
    lm.prefill([[1, 2, 3]])  # no host read per forward: the flag waits for check_finite
    with pytest.raises(NonFiniteLogits, match="NaN") as err:
        lm.check_finite()
    assert "target" in str(err.value)

    tiny_llama = llama(seed=0)
    lm = HFBatchedLM(tiny_llama, name="draft")
    lm.prefill([[1, 2, 3]])
    lm.check_finite()
    tiny_llama.lm_head.weight[7].fill_(float("nan"))  # breaks after prefill: the flag must catch it
    lm.extend(torch.ones(1, 2, dtype=torch.long))
    with pytest.raises(NonFiniteLogits, match="NaN"):
        lm.check_finite()
    lm.check_finite()  # the flag was reset by the check that raised


def test_bf16_fused_block_matches_token_by_token():
    # bf16 rounding differs between one fused forward and K small ones; only check closeness.
    tiny_llama = llama(seed=0, layers=3, dtype=torch.bfloat16)
    tokens = block(len(PROMPTS), 3, seed=9)
    fused = HFBatchedLM(tiny_llama)
    fused.prefill(PROMPTS)
    out = fused.extend(tokens)
    stepwise = HFBatchedLM(tiny_llama)
    stepwise.prefill(PROMPTS)
    steps = torch.stack([stepwise.extend(tokens[:, j : j + 1])[:, 0] for j in range(3)], 1)
    assert out.dtype == torch.float32
    scale = float(out.abs().max())
    torch.testing.assert_close(out, steps, atol=0.05 * scale, rtol=0.05)
    # greedy choices agree almost everywhere
    assert (out.argmax(-1) == steps.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("plain_head", [True, False])
def test_extend_over_a_vocabulary_subset_returns_those_logits(tiny_llama, plain_head):
    # plain_head=False stands for a tiny_llama that scales or soft-caps its logits after the head:
    # the backend must then run the full forward and pick the columns.
    vocab = torch.tensor([3, 17, 250, 299])
    lm = HFBatchedLM(tiny_llama)
    lm.prefill(PROMPTS)
    assert lm.model_forward.has_plain_head()  # a Llama's logits are its head on the decoder's output
    lm.model_forward.plain_head = plain_head
    tokens = block(len(PROMPTS), 3)
    full = lm.extend(tokens)
    lm.drop_tail(torch.full((len(PROMPTS),), 3))
    part = lm.extend(tokens, vocab=vocab)
    assert part.shape == (len(PROMPTS), 3, len(vocab))
    torch.testing.assert_close(part, full[..., vocab], atol=ATOL, rtol=RTOL)


def test_indices_on_the_device_keep_logits_exact(tiny_llama, monkeypatch):
    # Masks, fork rows and drop counts that live on an accelerator are never read: the
    # backend then keeps only upper bounds of the row lengths, and must stay exact.
    lm = HFBatchedLM(tiny_llama)
    lm.prefill(PROMPTS)  # host bookkeeping first: exact, unequal row lengths
    monkeypatch.setattr(kv, "on_host", lambda t: False)
    tokens = block(len(PROMPTS), 4, seed=13)
    valid = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    lm.extend(tokens, valid)
    seqs = [p + tokens[i][valid[i]].tolist() for i, p in enumerate(PROMPTS)]
    lm.fork(torch.tensor([3, 3, 0, 2]))
    seqs = [seqs[r] for r in (3, 3, 0, 2)]
    more = block(4, 3, seed=14)
    lm.extend(more)
    lm.drop_tail(torch.tensor([2, 0, 1, 3]))
    seqs = [s + more[i, : 3 - d].tolist() for i, (s, d) in enumerate(zip(seqs, (2, 0, 1, 3)))]
    assert all(b >= n for b, n in zip(lm.bound, lm.lengths.tolist()))
    out = lm.extend(torch.tensor([[1], [2], [3], [4]]))
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i], scratch_logits(tiny_llama, s + [i + 1], 1), atol=ATOL, rtol=RTOL)


def test_a_tree_read_with_the_queued_tokens_leaves_the_rows_as_a_plain_read(tiny_llama):
    # RowStore.next_logits_and_trees (the structure twist): the queued tokens and a tree after
    # them in one forward; the rows then hold the queued tokens only, as after next_logits.
    from smcsd_ppl.inference.rows import RowStore

    store = RowStore(HFBatchedLM(tiny_llama), HFBatchedLM(tiny_llama))
    store.start(PROMPTS[:3], [0, 1, 2])
    store.queue({0: [21], 1: [22, 23]})  # row 2 has nothing queued: its tree hangs from its end
    trees = [([30, 31, 32], [-1, 0, -1]), ([], []), ([40], [-1])]
    logits, nodes = store.next_logits_and_trees([0, 1, 2], trees)
    seqs = [PROMPTS[0] + [21], PROMPTS[1] + [22, 23], PROMPTS[2]]
    paths = [[[30], [30, 31], [32]], [], [[40]]]
    for r in range(3):
        torch.testing.assert_close(logits[r], scratch_logits(tiny_llama, seqs[r]), atol=ATOL, rtol=RTOL)
        for j, path in enumerate(paths[r]):
            want = scratch_logits(tiny_llama, seqs[r] + path)
            torch.testing.assert_close(nodes[r][j], want, atol=ATOL, rtol=RTOL)
    store.queue({r: [50] for r in range(3)})
    after = store.next_logits([0, 1, 2])
    for r in range(3):
        torch.testing.assert_close(after[r], scratch_logits(tiny_llama, seqs[r] + [50]), atol=ATOL, rtol=RTOL)

"""RACER: the retrieval index, tree attention, greedy equivalence, exact sampling, block proposals."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import EOS, chi_square_pvalue, exact_target, scratch_logits
from tiny import llama, pair, tokenizer

from smcsd_ppl.api import SMCSD
from smcsd_ppl.backends.hf import HFBatchedLM
from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.methods.ar import autoregressive
from smcsd_ppl.methods.racer import racer_generate
from smcsd_ppl.proposals.retrieval import NGramIndex, RetrievalDrafter


def greedy(lm, prompts, **kw):
    """Greedy autoregressive decoding, the reference RACER must reproduce."""
    return autoregressive(lm, prompts, temperature=0.0, **kw)


def walk(index, seq):
    node = index.root
    for t in seq:
        node = node.children[t]
    return node


def test_index_counts_fail_links_and_matches():
    index = NGramIndex(n=3)
    index.feed([], [1, 2, 3, 1, 2, 4])
    assert walk(index, [1, 2]).count == 2 and walk(index, [2, 3]).count == 1
    assert walk(index, [1, 2, 3]).fail is walk(index, [2, 3])
    assert walk(index, [2, 4]).fail is walk(index, [4])
    assert max(len(walk(index, [a]).children) for a in (1, 2, 3, 4)) == 2  # depth <= n only
    assert not walk(index, [1, 2, 3]).children
    node = index.match([9, 9, 3, 1, 2])  # longest suffix present: [3, 1, 2]
    assert [s.depth for s in index.suffixes(node)] == [3, 2]
    assert index.step(index.match([7, 1]), 4).depth == 1  # "1 4" never seen: falls back to "4"


def test_index_eviction_keeps_recent_ngrams_and_links():
    index = NGramIndex(n=4, max_nodes=60)
    active = index.feed([], list(range(100, 140)))  # old n-grams, soon evicted
    for t in range(20):
        active = index.feed(active, [t % 7, (t * 3) % 5])
    assert index.size <= 60
    stack, seen = [index.root], 0
    while stack:  # every surviving node's fail link survives too
        node = stack.pop()
        seen += 1
        for child in node.children.values():
            assert child.fail is index.root or child.fail.stamp >= index.floor
            stack.append(child)
    assert seen == index.size
    assert 100 not in index.root.children  # the oldest n-grams went first
    assert index.match([0, 3]).depth >= 1


def test_draft_tree_from_retrieval_then_logit_cues():
    d = RetrievalDrafter(50, n=6, k=8)
    d.index.feed([], [1, 2, 3, 4, 5, 6, 7, 1, 2])
    d.cues.table[2] = torch.arange(10, 18)
    tree = d.build_draft_tree([9, 1, 2], budget=12)
    # the copy goes on past n tokens (through fail links), then the cues fill the root's breadth
    assert tree.tokens[:8] == [2, 3, 4, 5, 6, 7, 1, 2] and tree.parents[:8] == [-1, 0, 1, 2, 3, 4, 5, 6]
    assert tree.tokens[8:] == [10, 11, 12, 13] and set(tree.parents[8:]) == {0}
    shallow = d.build_draft_tree([9, 1, 2], budget=12, max_depth=2)
    assert shallow.tokens == [2, 3, 4, *range(10, 18)] and max(shallow.depth) == 2


def test_logit_cue_tree_halves_breadth_with_depth():
    d = RetrievalDrafter(40, k=8)
    d.cues.table[:] = torch.arange(8)[None, :] + 10  # every token is followed by 10..17
    tree = d.build_draft_tree([5], budget=1 + 8 + 4)
    assert tree.parents == [-1] + [0] * 8 + [1] * 4  # breadth-first
    tree = d.build_draft_tree([5], budget=64)
    kids = Counter(tree.parents)
    # the root's children get breadths 8, 4, 2, 1, ...; their children start at half of that
    assert [kids[j] for j in range(1, 9)] == [8, 4, 2, 1, 1, 1, 1, 1]
    assert [kids[j] for j in range(9, 17)] == [4, 2, 1, 1, 1, 1, 1, 1]
    for j, p in enumerate(tree.parents[1:], 1):
        assert p < j and tree.children[p][tree.tokens[j]] == j  # siblings are distinct


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_logits_equal_paths_from_scratch_and_keep_path(attn):
    model = llama(seed=3, layers=2)
    model.config._attn_implementation = attn
    lm = HFBatchedLM(model)
    seqs = [[5, 6, 7, 8], [9, 10]]
    lm.prefill(seqs)
    lm.extend(torch.tensor([[20, 21], [22, 23]]))
    lm.drop_tail(torch.tensor([0, 1]))  # a hole inside row 1
    seqs = [seqs[0] + [20, 21], seqs[1] + [22]]
    tokens = torch.tensor([[11, 12, 13, 14, 15], [31, 32, 33, 34, 35]])
    parents = torch.tensor([[-1, 0, 0, 1, 3], [-1, 0, 1, 1, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]).bool()
    logits = lm.extend_tree(tokens, parents, valid)
    for r in range(2):
        for j in range(5):
            if valid[r, j]:
                path, k = [], j
                while k >= 0:
                    path.insert(0, int(tokens[r, k]))
                    k = int(parents[r, k])
                expect = scratch_logits(model, seqs[r] + path)
                torch.testing.assert_close(logits[r, j], expect, atol=1e-4, rtol=1e-4)
    lm.keep_path(torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0]]).bool())
    seqs = [seqs[0] + [11, 12, 14], seqs[1] + [31]]
    out = lm.extend(torch.tensor([[3], [4]]))[:, -1]
    for r, nxt in enumerate((3, 4)):
        torch.testing.assert_close(out[r], scratch_logits(model, seqs[r] + [nxt]), atol=1e-4, rtol=1e-4)
    assert lm.lengths.tolist() == [len(s) + 1 for s in seqs]


def test_tree_errors():
    lm = HFBatchedLM(llama(seed=3, layers=1))
    lm.prefill([[1, 2]])
    with pytest.raises(ValueError, match="parent"):
        lm.extend_tree(torch.tensor([[1, 2]]), torch.tensor([[-1, 1]]))
    with pytest.raises(ValueError, match="must both be"):
        lm.extend_tree(torch.tensor([[1, 2]]), torch.tensor([[-1]]))


@pytest.mark.parametrize("budget", [1, 6, 64])
def test_greedy_racer_equals_greedy_autoregressive_tiny(budget):
    model = llama(seed=0, layers=3, eos_bias=4.0)
    lm = HFBatchedLM(model)
    tok = tokenizer()
    prompts = [tok("the cat sat on the mat. the cat")["input_ids"], tok("Once upon a time")["input_ids"], [7]]
    eos = [tok.eos_token_id]
    ref = greedy(lm, prompts, eos_token_ids=eos, max_new_tokens=30)
    d = RetrievalDrafter(lm.vocab_size)
    for _ in range(2):  # the second pass reuses the index: more accepted, same tokens
        run = racer_generate(lm, prompts, d, eos_token_ids=eos, max_new_tokens=30, budget=budget)
        assert run.token_ids == ref
    assert any(o[-1] == eos[0] and len(o) < 30 for o in ref)  # EOS stops a row early
    if budget > 1:
        assert run.tokens_per_step > 1.5


def test_greedy_racer_equals_greedy_autoregressive_mock():
    for seed in range(4):
        mock = MockLM(5, seed=seed)
        prompts = [[1, 2], [0, 4, 1]]
        ref = greedy(mock, prompts, eos_token_ids=[3], max_new_tokens=25)
        run = racer_generate(
            mock, prompts, RetrievalDrafter(5), eos_token_ids=[3], max_new_tokens=25, budget=8
        )
        assert run.token_ids == ref


def test_racer_sampling_reproduces_the_target():
    target = MockLM(4, seed=0, scale=1.5)
    runs, horizon = 3000, 4
    out = racer_generate(
        target,
        [[1, 2]] * runs,
        RetrievalDrafter(4, n=4),
        eos_token_ids=[EOS],
        max_new_tokens=horizon,
        budget=6,
        sampling=(1.0, torch.Generator().manual_seed(0)),
    )
    assert out.accepted > 0.3 * out.steps  # drafts were used, not only bonus tokens
    exact, z = exact_target(target, [1, 2], horizon)
    assert z == pytest.approx(1.0)
    assert chi_square_pvalue(Counter(map(tuple, out.token_ids)), exact) > 1e-3


def test_racer_is_registered_and_runs_through_generate():
    target, draft = pair()
    smc = SMCSD(target, draft)
    config = SMCConfig(max_new_tokens=12, ignore_eos=True)
    out = smc.generate(["the cat sat", "the sun rises"], method="racer", config=config)
    ref = greedy(
        smc.target_lm,
        [smc.encode(p) for p in ["the cat sat", "the sun rises"]],
        eos_token_ids=[],
        max_new_tokens=12,
    )
    assert [o.token_ids for o in out] == ref and out[0].stats.target_calls <= 12
    sampled = smc.generate("the cat sat", method="racer_sampling", config=config)
    assert len(sampled.token_ids) == 12
    smc.retrieval_memory = RetrievalDrafter(smc.target_lm.vocab_size)  # kept across calls: it learns
    smc.generate("the cat sat", method="racer", config=config)
    assert smc.retrieval_memory.index.size > 1


@pytest.mark.slow
def test_greedy_racer_equals_greedy_autoregressive_real_model():
    smc = SMCSD.load(dtype="float32")  # bf16 ties could flip an argmax between batch shapes
    prompts = [smc.encode("Write a short poem about the sea."), smc.encode("List three prime numbers.")]
    ref = greedy(smc.target_lm, prompts, eos_token_ids=[], max_new_tokens=32)
    run = racer_generate(
        smc.target_lm,
        prompts,
        RetrievalDrafter(smc.target_lm.vocab_size),
        eos_token_ids=[],
        max_new_tokens=32,
    )
    assert run.token_ids == ref

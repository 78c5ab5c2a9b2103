"""The shipped contracts, run on every backend and constraint; broken ones must fail them."""

from __future__ import annotations

import pytest
import torch
from tiny import llama

from smcsd_ppl.backends.base import BatchedLM, TreeLM
from smcsd_ppl.backends.contract import BatchedLMContract, ContractError
from smcsd_ppl.backends.hf import HFBatchedLM
from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.bench.fidelity import MixedDraft


@pytest.fixture(scope="module")
def model():
    return llama(seed=0, layers=3)


def scratch(model):
    """Logits after a sequence from one plain forward: a reference independent of the backend."""

    def logits(seq):
        with torch.inference_mode():
            return model(torch.tensor([list(seq)])).logits[0, -1].float()

    return logits


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_backend_keeps_the_contract(model, attn):
    model.config._attn_implementation = attn
    try:
        BatchedLMContract(lambda: HFBatchedLM(model), reference=scratch(model)).check_all()
    finally:
        model.config._attn_implementation = "sdpa"


def test_hf_backend_keeps_the_contract_against_its_own_prefill(model):
    BatchedLMContract(lambda: HFBatchedLM(model), seed=1).check_all()


def mock():
    return MockLM(6, order=3, seed=4)


def test_mock_keeps_the_contract():
    BatchedLMContract(mock, reference=mock().next_logits, atol=0, rtol=0).check_all()


def test_backends_satisfy_the_protocols(model):
    hf, mixed = HFBatchedLM(model), MixedDraft(HFBatchedLM(model), HFBatchedLM(model), 0.5, 1.0)
    assert isinstance(hf, TreeLM) and isinstance(mock(), TreeLM)
    assert isinstance(mixed, BatchedLM) and not isinstance(mixed, TreeLM)


# Broken backends: each breaks one promise, and the check of that promise must raise.


class KeepsDroppedTail(MockLM):
    def drop_tail(self, n):
        super().drop_tail(torch.zeros_like(n))  # forgets to move the rows back


class SeesHoles(MockLM):
    def extend(self, tokens, valid=None, hidden=None, *, vocab=None):
        return super().extend(tokens, None, hidden, vocab=vocab)  # holes read as real tokens


class CountsPadding(MockLM):
    def prefill(self, prompts, hidden=None):
        width = max(len(p) for p in prompts)
        return super().prefill([[1] * (width - len(p)) + list(p) for p in prompts])  # padding as tokens


class SortsForks(MockLM):
    def fork(self, rows):
        super().fork(rows.sort().values)  # loses the order of the rows asked for


class RepeatsLastLogits(MockLM):
    def extend(self, tokens, valid=None, hidden=None, *, vocab=None):
        out = super().extend(tokens, valid, hidden, vocab=vocab)
        return out[:, -1:].expand_as(out)  # a fused block scored at its last position only


class FirstColumns(MockLM):
    def extend(self, tokens, valid=None, hidden=None, *, vocab=None):
        out = super().extend(tokens, valid, hidden)
        return out if vocab is None else out[..., : len(vocab)]  # not the columns asked for


class KeepsNoPath(MockLM):
    def keep_path(self, keep):
        super().keep_path(torch.zeros_like(keep))  # forgets the accepted path


class LeafLogitsOnRoots(MockLM):
    def _tree_logits(self, tokens, anc, depth, valid):
        out = super()._tree_logits(tokens, anc, depth, valid)
        return out.flip(1)  # nodes get other nodes' logits


@pytest.mark.parametrize(
    "broken, check",
    [
        (KeepsDroppedTail, "drop_tail_equals_recompute"),
        (SeesHoles, "holes_invisible"),
        (CountsPadding, "padding_invisible"),
        (SortsForks, "fork_equals_recompute"),
        (RepeatsLastLogits, "fused_equals_stepwise"),
        (FirstColumns, "vocab_subset"),
        (KeepsNoPath, "tree"),
        (LeafLogitsOnRoots, "tree"),
    ],
)
def test_each_backend_check_fails_a_backend_that_breaks_it(broken, check):
    contract = BatchedLMContract(lambda: broken(6, order=3, seed=4), reference=mock().next_logits, atol=0)
    with pytest.raises(ContractError, match=check):
        getattr(contract, f"check_{check}")()
    with pytest.raises(ContractError):
        contract.check_all()


class HFForgetsToRewind(HFBatchedLM):
    def drop_tail(self, n):
        super().drop_tail(torch.zeros_like(n))  # the write position stays: dropped tokens stay seen


def test_the_contract_fails_an_hf_backend_that_forgets_to_rewind(model):
    contract = BatchedLMContract(lambda: HFForgetsToRewind(model), reference=scratch(model))
    with pytest.raises(ContractError, match="drop_tail"):
        contract.check_all()

"""The shipped contracts, run on every backend and constraint; broken ones must fail them."""

from __future__ import annotations

from functools import partial

import helpers as exact
import pytest
import torch
from helpers import regex_contract, scratch_logits

from smcsd_ppl.backends.base import BatchedLM, TreeLM
from smcsd_ppl.backends.contract import BatchedLMContract, ContractError
from smcsd_ppl.backends.fixed import Buckets, FixedShape, ShapedLM
from smcsd_ppl.backends.hf import HFBatchedLM
from smcsd_ppl.backends.llama import LlamaForward
from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.bench.fidelity import MixedDraft
from smcsd_ppl.potentials import PotentialConstraint, RegexConstraint
from smcsd_ppl.potentials.contract import ConstraintContract


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_backend_keeps_the_contract(tiny_llama, attn):
    tiny_llama.config._attn_implementation = attn
    try:
        BatchedLMContract(
            lambda: HFBatchedLM(tiny_llama), reference=partial(scratch_logits, tiny_llama)
        ).check_all()
    finally:
        tiny_llama.config._attn_implementation = "sdpa"


def test_hf_backend_keeps_the_contract_against_its_own_prefill(tiny_llama):
    BatchedLMContract(lambda: HFBatchedLM(tiny_llama), seed=1).check_all()


@pytest.mark.parametrize("seed", [0, 1])
def test_our_forward_keeps_the_contract_against_the_model_s_own(tiny_llama, seed):
    BatchedLMContract(
        lambda: HFBatchedLM(tiny_llama, compiled=LlamaForward(tiny_llama)),
        reference=partial(scratch_logits, tiny_llama),
        seed=seed,
    ).check_all()


@pytest.mark.parametrize("shape", [FixedShape(rows=8, width=128), Buckets(step=16)])
def test_shaped_backends_keep_the_contract_but_trees(tiny_llama, shape):
    """Forwards at set shapes (``--deterministic``, an accelerator's graphs) compute the same function."""
    contract = BatchedLMContract(
        lambda: ShapedLM(tiny_llama, shape, compiled=LlamaForward(tiny_llama)),
        reference=partial(scratch_logits, tiny_llama),
    )
    for name in contract.CHECKS:
        if name != "tree":
            getattr(contract, f"check_{name}")()
    with pytest.raises(ValueError, match="token trees"):
        contract.check_tree()


def mock():
    return MockLM(6, order=3, seed=4)


def test_mock_keeps_the_contract():
    BatchedLMContract(mock, reference=mock().next_logits, atol=0, rtol=0).check_all()


def test_backends_satisfy_the_protocols(tiny_llama):
    hf, mixed = (
        HFBatchedLM(tiny_llama),
        MixedDraft(HFBatchedLM(tiny_llama), HFBatchedLM(tiny_llama), 0.5, 1.0),
    )
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


class AppendsBefore(MockLM):
    def append(self, prompts):
        n = self.n_rows
        out = super().append(prompts)
        order = [*range(n, self.n_rows), *range(n)]  # the joining rows land first
        self.history, self.rows = self.history[order], type(self.rows)(self.rows.valid[order])
        return out


@pytest.mark.parametrize(
    "broken, check",
    [
        (KeepsDroppedTail, "drop_tail_equals_recompute"),
        (SeesHoles, "holes_invisible"),
        (CountsPadding, "padding_invisible"),
        (SortsForks, "fork_equals_recompute"),
        (RepeatsLastLogits, "fused_equals_stepwise"),
        (FirstColumns, "vocab_subset"),
        (AppendsBefore, "append_keeps_rows"),
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


def test_the_contract_fails_an_hf_backend_that_forgets_to_rewind(tiny_llama):
    contract = BatchedLMContract(
        lambda: HFForgetsToRewind(tiny_llama), reference=partial(scratch_logits, tiny_llama)
    )
    with pytest.raises(ContractError, match="drop_tail"):
        contract.check_all()


# Constraints: the regex constraint, genlm-control potentials and the test constraints.

PATTERNS = [r"(the|a) [a-z]+( [a-z]+)?\.", r"[0-9]{1,3}(,[0-9]{3})*"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_constraint_keeps_the_contract(pattern):
    regex_contract(RegexConstraint, pattern).check_all()


def test_genlm_control_potential_keeps_the_contract():
    from genlm.control import BoolFSA

    def make(pattern, tok, eos):
        return PotentialConstraint(BoolFSA.from_regex(pattern), tok, eos)

    regex_contract(make, PATTERNS[0]).check_all()


TEST_CONSTRAINTS = {
    "NoOneZero": (exact.NoOneZero, exact.satisfies_prefix, lambda s: exact.satisfies_prefix(s) and 2 in s),
    "Nothing": (exact.Nothing, lambda s: False, lambda s: False),
    "DeadEnd": (exact.DeadEnd, lambda s: list(s) in ([], [1]), lambda s: False),
    "Forced": (
        exact.Forced,
        exact.forced_prefix,
        lambda s: exact.forced_prefix(s) and len(s) % 4 not in (1, 2),
    ),
}


def small_contract(make, viable, complete, **kw):
    return ConstraintContract(make, exact.V, [exact.EOS], viable=viable, complete=complete, **kw)


@pytest.mark.parametrize("name", TEST_CONSTRAINTS)
def test_the_test_constraints_keep_the_contract(name):
    small_contract(*TEST_CONSTRAINTS[name], depth=9).check_all()


# Broken constraints: each breaks one promise, and the check of that promise must raise.


class EarlyEOS(RegexConstraint):
    def next_mask(self, contexts):
        out = super().next_mask(contexts).clone()
        out[:, list(self.eos_token_ids)] = True  # lets the output end before the match is complete
        return out


class AllowsAnything(RegexConstraint):
    def allows(self, sequences):
        return [True] * len(sequences)  # disagrees with the masks on refused tokens


class ForgetsOneZero(exact.NoOneZero):
    def next_mask(self, contexts):
        out = super().next_mask(contexts)
        for i, c in enumerate(contexts):
            if exact.satisfies_prefix(c) and c and c[-1] == 1:
                out[i, 0] = True  # the bigram (1, 0) the language forbids
        return out


class BatchDependent(exact.NoOneZero):
    def next_mask(self, contexts):
        out = super().next_mask(contexts)
        return out if len(out) == 1 else out.roll(1, 0)  # rows of a batch mixed up


@pytest.mark.parametrize(
    "contract, check",
    [
        (lambda: regex_contract(EarlyEOS, PATTERNS[0]), "eos_only_when_complete"),
        (lambda: regex_contract(AllowsAnything, PATTERNS[0]), "mask_agrees_with_allows"),
        (lambda: small_contract(ForgetsOneZero, *TEST_CONSTRAINTS["NoOneZero"][1:]), "mask_matches_language"),
        (lambda: small_contract(BatchDependent, *TEST_CONSTRAINTS["NoOneZero"][1:]), "batch_equals_single"),
    ],
)
def test_each_constraint_check_fails_a_constraint_that_breaks_it(contract, check):
    contract = contract()
    with pytest.raises(ContractError, match=check):
        getattr(contract, f"check_{check}")()
    with pytest.raises(ContractError):
        contract.check_all()

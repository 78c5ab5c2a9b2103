"""Exactness on a real model's forwards: a tiny Llama whose vocabulary can be enumerated.

The mock pair (``test_outputs_exact``, ``test_exact``) checks the algorithm; here the same
checks run over the backends' forwards, on both paths: the model's own forward (the reference)
and ours (``backends.llama``, its parts as they are or compiled). A Llama of four tokens,
EOS among them, gives every output of up to ``H`` tokens an exact probability, and the outputs
SMC-SD returns are held to it. Resampling moves particles' cache rows (``RowCache.fork``):
a mutant that leaves a row stale after a resample fails the same check.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import EOS, V, exact_target, marginal_tv, smc
from transformers import LlamaConfig, LlamaForCausalLM

from smcsd_ppl.backends import kv
from smcsd_ppl.backends.hf import HFBatchedLM
from smcsd_ppl.backends.llama import LlamaForward
from smcsd_ppl.backends.packages import CompiledParts
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.potentials import Constraint

PROMPT, H, RUNS = [1, 2], 4, 1000
TV_LIMIT = 0.05  # the marginals' sampling noise at RUNS is ~0.02


def law_llama(seed: int, like: LlamaForCausalLM | None = None, noise: float = 0.0) -> LlamaForCausalLM:
    """A random Llama over ``V`` tokens whose logits are spread enough to matter (EOS is token ``EOS``).

    ``like``: a copy of that model, its output layer perturbed by ``noise`` (a draft whose p/q
    stays bounded, as a distilled draft's does).
    """
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=EOS,
        bos_token_id=EOS,
        pad_token_id=EOS,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        if like is not None:
            model.load_state_dict(like.state_dict())
            model.lm_head.weight.add_(noise * torch.randn(model.lm_head.weight.shape))
        else:
            model.lm_head.weight.mul_(40.0)
    return model.eval().requires_grad_(False)


class Law:
    """A model's next-token logits for any context, one plain forward each (what ``exact_target`` reads)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model, self.vocab_size = model, V

    @torch.inference_mode()
    def next_logits(self, seq) -> torch.Tensor:
        return self.model(torch.tensor([list(seq)])).logits[0, -1].float()


TARGET = law_llama(0)
DRAFT = law_llama(1, like=TARGET, noise=0.45)
EXACT = {}


def exact(alpha: float = 1.0) -> dict:
    if alpha not in EXACT:
        EXACT[alpha] = exact_target(Law(TARGET), PROMPT, H, alpha=alpha)[0]
    return EXACT[alpha]


def backend(model, path: str, tmp_path_factory=None) -> HFBatchedLM:
    if path == "reference":
        return HFBatchedLM(model)
    parts = None
    if path == "compiled":
        parts = CompiledParts(tmp_path_factory.getbasetemp() / "graphs")
        forward = LlamaForward(model, parts)
        parts.build(forward.shape, torch.device("cpu"))
        assert parts.ready(forward.shape, torch.device("cpu")), parts.failed
    return HFBatchedLM(model, compiled=LlamaForward(model, parts))


PATHS = ["reference", "ours", pytest.param("compiled", marks=pytest.mark.slow)]
# The checks beyond the first: ours in the fast tier, the other paths in the full one.
MORE_PATHS = [pytest.param("reference", marks=pytest.mark.slow), *PATHS[1:]]


def returned(path, factory, program=lambda: SMCSDModel(PROMPT), **cfg) -> list[list[int]]:
    base = dict(block_size=2, max_new_tokens=H, draft_temperature=1.0, seed=3, n_particles=32)
    target, draft = backend(TARGET, path, factory), backend(DRAFT, path, factory)
    return [r.token_ids for r in smc(target, draft, [program() for _ in range(RUNS)], **(base | cfg))]


def test_the_draft_differs_from_the_target_enough_to_matter():
    one = returned("reference", None, n_particles=1, cut=None)  # outputs are then draft samples
    assert marginal_tv(one, exact(), H) > 2 * TV_LIMIT


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cut", [pytest.param(None, marks=pytest.mark.slow), 0.3])
def test_returned_outputs_follow_the_target(path, cut, tmp_path_factory):
    tv = marginal_tv(returned(path, tmp_path_factory, cut=cut), exact(), H)
    assert tv < TV_LIMIT, tv


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_a_power_target_returns_power_outputs(path, tmp_path_factory):
    outs = returned(path, tmp_path_factory, alpha=2.0, cut=None, n_particles=64)  # p^2 / q: more spread
    tv = marginal_tv(outs, exact(2.0), H)
    assert tv < TV_LIMIT, tv


class NoZero(Constraint):
    """Never token 0."""

    def next_mask(self, contexts):
        mask = torch.ones(len(contexts), V, dtype=torch.bool)
        mask[:, 0] = False
        return mask


@pytest.mark.parametrize("path", MORE_PATHS)
def test_a_constraint_returns_the_target_conditioned_on_it(path, tmp_path_factory):
    want = {y: w for y, w in exact().items() if 0 not in y}
    outs = returned(path, tmp_path_factory, program=lambda: SMCSDModel(PROMPT, NoZero()), cut=0.3)
    assert outs and not any(0 in o for o in outs)
    assert marginal_tv(outs, want, H) < TV_LIMIT


@pytest.mark.parametrize("path", MORE_PATHS)
def test_log_z_is_an_unbiased_estimate(path, tmp_path_factory):
    target, draft = backend(TARGET, path, tmp_path_factory), backend(DRAFT, path, tmp_path_factory)
    base = dict(block_size=2, max_new_tokens=H, draft_temperature=1.0, seed=5, n_particles=4, cut=None)
    outs = smc(target, draft, [SMCSDModel(PROMPT) for _ in range(RUNS)], **base)
    estimates = torch.tensor([math.exp(o.smc.log_z) for o in outs], dtype=torch.float64)
    error = estimates.std() / math.sqrt(len(estimates))
    assert abs(estimates.mean() - sum(exact().values())) < 4 * error, (estimates.mean(), error)


@pytest.mark.parametrize("stale", [False, True])
def test_a_row_left_stale_after_a_resample_fails_the_check(monkeypatch, stale):
    """The mutant: a resample that moves a particle's state but not its cache row.

    One token a block, so a request runs cycles after it resamples, reading the rows it moved.
    """
    if stale:
        monkeypatch.setattr(kv, "_copy_rows", lambda t, dest, src, used: t)
    tv = marginal_tv(returned("ours", None, cut=None, ess_threshold=1.0, block_size=1), exact(), H)
    assert (tv > TV_LIMIT) == stale, tv

"""HF assisted generation / prompt lookup as registered methods, on tiny random Llamas."""

from __future__ import annotations

import copy
import math

import pytest
import tiny
import torch

from smcsd_ppl import methods
from smcsd_ppl.api import SMCSD
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.models import LoadedModel
from smcsd_ppl.models.drafts import slice_draft

PROMPTS = ["the quick brown fox", "once upon a time there was"]


@pytest.mark.parametrize("method", ["hf_assisted", "hf_prompt_lookup"])
def test_runs_within_budget_and_counts_forwards(tiny_smcsd, method):
    assert method in methods.METHODS
    outs = tiny_smcsd.generate(PROMPTS, method=method, config=SMCConfig(max_new_tokens=12, block_size=3))
    assert [len(o.token_ids) for o in outs] == [12, 12]  # random weights: EOS is rare
    assert all(o.method == method and o.text == tiny_smcsd.decode(o.token_ids) for o in outs)
    stats = outs[0].stats
    assert 2 <= stats.target_calls <= 2 * 12  # one prefill per prompt, at most one call per token
    assert stats.target_seconds > 0 and stats.new_tokens == 24
    assert (stats.draft_calls > 0) == (method == "hf_assisted")


def test_assistant_config_is_restored(tiny_smcsd):
    cfg = tiny_smcsd.draft.model.generation_config
    before = cfg.to_dict()
    tiny_smcsd.generate(PROMPTS[0], method="hf_assisted", config=SMCConfig(max_new_tokens=6, block_size=5))
    assert tiny_smcsd.draft.model.generation_config is cfg
    assert cfg.to_dict() == before


@pytest.mark.parametrize("method", ["hf_assisted", "hf_prompt_lookup"])
def test_seeded_determinism(tiny_smcsd, method):
    def run(seed):
        cfg = SMCConfig(
            max_new_tokens=6, block_size=2, seed=seed, draft_temperature=1.0, target_temperature=1.0
        )
        return tiny_smcsd.generate(PROMPTS[1], method=method, config=cfg).token_ids

    state = torch.random.get_rng_state()
    assert run(3) == run(3)
    assert run(3) != run(4)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched


def test_stops_at_eos():
    p = SMCSD(*tiny.pair(eos_bias=10.0))
    outs = p.generate(PROMPTS * 2, method="hf_assisted", config=SMCConfig(max_new_tokens=24, block_size=3))
    eos = set(p.eos_token_ids)
    assert any(o.token_ids[-1] in eos for o in outs)
    assert all(o.token_ids[-1] in eos or len(o.token_ids) == 24 for o in outs)
    assert all(not eos & set(o.token_ids[:-1]) for o in outs)
    long = p.generate(PROMPTS, method="hf_assisted", config=SMCConfig(max_new_tokens=10, ignore_eos=True))
    assert [len(o.token_ids) for o in long] == [10, 10]


def test_drafts_k_tokens_per_round():
    # A perfect assistant (a copy of the target): each target call yields K + 1 tokens,
    # so K is honored and no confidence threshold stops drafting early.
    target, _ = tiny.pair()
    twin = LoadedModel(copy.deepcopy(target.model), target.tokenizer, "twin", "copy")
    k, n = 3, 16
    out = SMCSD(target, twin).generate(
        PROMPTS[0], method="hf_assisted", config=SMCConfig(max_new_tokens=n, block_size=k)
    )
    assert len(out.token_ids) == n
    assert out.stats.target_calls <= math.ceil(n / (k + 1)) + 1


def test_layer_slice_draft_works():
    target, _ = tiny.pair()
    p = SMCSD(target, slice_draft(target, 1))
    outs = p.generate(PROMPTS, method="hf_assisted", config=SMCConfig(max_new_tokens=8))
    assert [len(o.token_ids) for o in outs] == [8, 8]
    with pytest.raises(ValueError, match="alpha"):
        p.generate(PROMPTS, method="hf_assisted", config=SMCConfig(alpha=2.0, max_new_tokens=8))

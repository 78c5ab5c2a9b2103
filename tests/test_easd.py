"""EASD: exact when its rule is off, and a veto that fires and never returns the vetoed token."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers import EOS, chi_square_pvalue, config, exact_target, mock_pair, sd

import smcsd_ppl.methods.sd as sd_module
from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.inference.rows import RowStore
from smcsd_ppl.methods.easd import EASDConfig, easd_sampling
from smcsd_ppl.verification.easd import easd_accept, entropy, topn_overlap, uncertain_agreement

PROMPT, H = [1, 2], 4

OFF = [EASDConfig(enabled=False), EASDConfig(tau_q=math.inf, tau_p=math.inf)]


@pytest.mark.parametrize("t_t", [1.0, 0.6])
@pytest.mark.parametrize("rule", OFF, ids=["disabled", "infinite-thresholds"])
def test_easd_without_its_rule_is_exact_sd(rule, t_t):
    target, draft = mock_pair()
    cfg = dict(block_size=2, max_new_tokens=H, draft_temperature=0.8, target_temperature=t_t, seed=1)
    runs = 3000
    out = easd_sampling(RowStore(target, draft), config(**cfg), [EOS], [PROMPT] * runs, easd=rule)
    exact_sd = sd(target, draft, [PROMPT] * runs, **cfg)
    assert out.token_ids == exact_sd.token_ids  # same random stream, same tokens
    assert out.accepted == exact_sd.accepted and out.drafted == exact_sd.drafted
    assert sum(out.vetoes) == 0
    exact, z = exact_target(target, PROMPT, H, temperature=t_t)
    assert chi_square_pvalue(Counter(map(tuple, out.token_ids)), {k: v / z for k, v in exact.items()}) > 1e-3


def flat_pair():
    """A flat target (high entropy everywhere) and a draft equal to it: SD accepts every token."""
    target = MockLM(4, seed=3, scale=0.3)
    return target, MockLM(table=target.table.clone())


def test_veto_fires_and_never_returns_the_drafted_token(monkeypatch):
    target, draft = flat_pair()
    # q = p: SD alone accepts every drafted token, so any cut is the rule's.
    exact_sd = sd(
        target, draft, [PROMPT] * 200, block_size=3, max_new_tokens=8, draft_temperature=1.0, seed=0
    )
    assert sum(exact_sd.accepted) == sum(exact_sd.drafted)
    # Entropies of these near-uniform 4-token distributions exceed 1 nat everywhere and
    # the top-2 sets agree (q = p): the rule vetoes d_1 of every block.
    rule = EASDConfig(tau_q=1.0, tau_p=1.0, top_n=2, overlap=0.5)
    real = sd_module.draft_blocks
    for seed in range(20):
        cfg = SMCConfig(
            block_size=3, max_new_tokens=8, draft_temperature=1.0, target_temperature=1.0, seed=seed
        )
        blocks = []

        def spy(*args, blocks=blocks, **kwargs):
            blocks.append(real(*args, **kwargs)[0])
            return blocks[-1:]

        monkeypatch.setattr(sd_module, "draft_blocks", spy)
        run = easd_sampling(RowStore(target, draft), cfg, [], [PROMPT], easd=rule)  # no EOS: 7 cycles
        out = run.token_ids[0]
        assert run.accepted == [0] and run.vetoes == [len(blocks)] == [7]
        assert len(out) == 8  # x0, then one replacement token per cycle
        assert all(t != b.tokens[0] for t, b in zip(out[1:], blocks))


def test_easd_accept_resamples_without_the_vetoed_token():
    g = torch.Generator().manual_seed(0)
    r, k, v = 2000, 3, 5
    p = torch.softmax(torch.randn(r, k + 1, v, generator=g), -1)
    drafts = torch.randint(v, (r, k), generator=g)
    veto = torch.zeros(r, k, dtype=torch.bool)
    veto[:, 1] = True  # veto the second drafted token of every row
    n_acc, nxt, vetoed = easd_accept(p, p[:, :k].clone(), drafts, veto, g)
    assert bool((n_acc <= 1).all()) and bool(vetoed.all())  # q = p: only the veto cuts
    assert bool((nxt != drafts[:, 1]).all())
    # The replacement follows p without the vetoed token: check one frequent context.
    freq = Counter(nxt[(drafts[:, 1] == 0)].tolist())
    want = p[drafts[:, 1] == 0, 1, 1:].sum(0) / p[drafts[:, 1] == 0, 1, 1:].sum()
    got = torch.tensor([freq.get(t, 0) for t in range(1, v)], dtype=torch.float)
    assert torch.allclose(got / got.sum(), want, atol=0.05)


def test_rule_math():
    u = torch.full((4,), 0.25)
    peaked = torch.tensor([0.97, 0.01, 0.01, 0.01])
    assert float(entropy(u)) == pytest.approx(math.log(4))
    p_, q_ = torch.tensor([0.4, 0.3, 0.2, 0.1]), torch.tensor([0.1, 0.3, 0.2, 0.4])
    overlaps = [float(topn_overlap(p_, q_, n)) for n in (1, 2, 3, 4)]
    assert overlaps == pytest.approx([0.0, 0.5, 2 / 3, 1.0])  # {0}/{3}, {0,1}/{3,1}, ...
    p = torch.stack([u, peaked])[None]  # [1, 2, V]
    veto = uncertain_agreement(p, p, tau_q=1.0, tau_p=1.0, top_n=2, overlap=1.0)
    assert veto.tolist() == [[True, False]]  # the peaked position is certain
    with pytest.raises(ValueError):
        EASDConfig(tau_q=-1.0)
    with pytest.raises(ValueError):
        EASDConfig(overlap=1.5)


def test_registered_runner_on_tiny_llamas(tiny_smcsd):
    config = SMCConfig(max_new_tokens=8, ignore_eos=True)
    outs = tiny_smcsd.generate(["the quick brown fox", "once upon a time"], method="easd", config=config)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    for o in outs:
        spec = o.speculative
        assert o.method == "easd" and o.smc is None and o.message == ""
        assert 0 <= spec.acceptance <= 1
        assert isinstance(spec.entropy_rejections, int)

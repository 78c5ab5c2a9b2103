"""EASD: exact when its rule is off, and a veto that fires and never returns the vetoed token."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers import chi_square_pvalue, engine, exact_target
from test_exact import PROMPT, H, models

from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.inference.engine import BlockEngine
from smcsd_ppl.methods.easd import EASDConfig, easd_sampling
from smcsd_ppl.methods.sd import speculative_sampling
from smcsd_ppl.spec.easd import easd_accept, entropy, topn_overlap, uncertain_agreement

OFF = [EASDConfig(enabled=False), EASDConfig(tau_q=math.inf, tau_p=math.inf)]


@pytest.mark.parametrize("rule", OFF, ids=["disabled", "infinite-thresholds"])
def test_easd_without_its_rule_is_exact_sd(rule):
    target, draft = models()
    cfg = dict(block_size=2, max_new_tokens=H, draft_temperature=0.8, seed=1)
    runs = 3000
    out = easd_sampling(engine(target, draft, **cfg), [PROMPT] * runs, easd=rule)
    sd = speculative_sampling(engine(target, draft, **cfg), [PROMPT] * runs)
    assert out.token_ids == sd.token_ids  # same random stream, same tokens
    assert out.accepted == sd.accepted and out.drafted == sd.drafted
    assert sum(out.vetoes) == 0
    exact, z = exact_target(target, PROMPT, H)
    assert z == pytest.approx(1.0)
    assert chi_square_pvalue(Counter(map(tuple, out.token_ids)), exact) > 1e-3


def flat_pair():
    """A flat target (high entropy everywhere) and a draft equal to it: SD accepts every token."""
    target = MockLM(4, seed=3, scale=0.3)
    return target, MockLM(table=target.table.clone())


def test_veto_fires_and_never_returns_the_drafted_token():
    target, draft = flat_pair()
    # q = p: SD alone accepts every drafted token, so any cut is the rule's.
    eng = engine(target, draft, block_size=3, max_new_tokens=8, draft_temperature=1.0, seed=0)
    sd = speculative_sampling(eng, [PROMPT] * 200)
    assert sum(sd.accepted) == sum(sd.drafted)
    # Entropies of these near-uniform 4-token distributions exceed 1 nat everywhere and
    # the top-2 sets agree (q = p): the rule vetoes d_1 of every block.
    rule = EASDConfig(tau_q=1.0, tau_p=1.0, top_n=2, overlap=0.5)
    for seed in range(20):
        cfg = SMCConfig(
            block_size=3, max_new_tokens=8, draft_temperature=1.0, target_temperature=1.0, seed=seed
        )
        eng = BlockEngine(target, draft, [], cfg)  # no EOS: every run lasts 7 cycles
        blocks = []
        draft_blocks = eng.draft_blocks

        def spy(*args, draft_blocks=draft_blocks, blocks=blocks, **kwargs):
            blocks.append(draft_blocks(*args, **kwargs)[0])
            return blocks[-1:]

        eng.draft_blocks = spy
        run = easd_sampling(eng, [PROMPT], easd=rule)
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


def test_registered_runner_on_tiny_llamas():
    import tiny

    from smcsd_ppl.api import SMCSD

    pair = SMCSD(*tiny.pair())
    outs = pair.generate(
        ["the quick brown fox", "once upon a time"], method="easd", config=SMCConfig(max_new_tokens=8)
    )
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert all(o.method == "easd" and 0 <= o.acceptance <= 1 for o in outs)
    assert all(isinstance(o.entropy_rejections, int) and o.message == "" for o in outs)

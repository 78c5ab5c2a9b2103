"""Greedy decoding (T_t = 0): every method returns the target's argmax path, token for token.

SMC-SD keeps each drafted block up to its first token off the path and takes the argmax
there (``verification.greedy``); under a constraint the path is the likeliest allowed
token at each place. The path is computed here from the mock target's table alone. A
control with the greedy check taken out shows the same comparison fails when it should.
"""

from __future__ import annotations

import pytest
import torch
from helpers import EOS, NoOneZero, mock_pair, sd, smc

from smcsd_ppl.config import SMCConfig
from smcsd_ppl.inference import cycle
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.methods import METHODS

H = 6
PROMPTS = [[1, 2], [0], [2, 2, 1], [3, 0], [1], [0, 1, 2]]


def argmax_path(target, prompt, horizon=H, allowed=None) -> list[int]:
    """The target's greedy output: the likeliest (allowed) token at each place, to EOS or the budget."""
    out: list[int] = []
    while len(out) < horizon and (not out or out[-1] != EOS):
        logits = target.next_logits([*prompt, *out]).float()
        if allowed is not None:
            logits = logits.masked_fill(~allowed.next_mask([out])[0], -torch.inf)
        out.append(int(logits.argmax()))
    return out


def greedy(target, draft, programs, **cfg) -> list[list[int]]:
    base = dict(target_temperature=0.0, draft_temperature=1.0, max_new_tokens=H, seed=5)
    return [g.token_ids for g in smc(target, draft, programs, **(base | cfg))]


@pytest.mark.parametrize(
    "settings",
    [
        dict(n_particles=4, block_size=4, cut=None),
        dict(n_particles=8, block_size=3, cut=0.3),
        dict(n_particles=1, block_size=2, cut=0.3, proposal="retrieval"),
        dict(n_particles=2, block_size=4, cut=None, token_level=True),
    ],
    ids=["paper", "cut", "retrieval", "alone"],
)
def test_smcsd_at_temperature_zero_returns_the_argmax_path(settings):
    target, draft = mock_pair(noise=2.0)  # a draft far off: many blocks end early
    want = [argmax_path(target, p) for p in PROMPTS]
    assert greedy(target, draft, [SMCSDModel(p) for p in PROMPTS], **settings) == want
    assert len({tuple(w) for w in want}) > 2  # the prompts lead to different paths


def test_a_constrained_greedy_output_is_the_likeliest_allowed_path():
    target, draft = mock_pair(noise=2.0, rare_eos=True)
    want = [argmax_path(target, p, allowed=NoOneZero()) for p in PROMPTS]
    assert want != [argmax_path(target, p) for p in PROMPTS]  # the constraint changes some path
    got = greedy(target, draft, [SMCSDModel(p, NoOneZero()) for p in PROMPTS], n_particles=4, block_size=3)
    assert got == want


def test_greedy_does_not_depend_on_the_seed_or_the_draft():
    target, draft = mock_pair(noise=2.0)
    _, close = mock_pair(noise=0.3)
    runs = [
        greedy(target, d, [SMCSDModel(p) for p in PROMPTS], seed=s, n_particles=4, block_size=4)
        for d in (draft, close)
        for s in (1, 2)
    ]
    assert all(r == runs[0] for r in runs)


def test_speculative_decoding_at_temperature_zero_returns_the_argmax_path():
    target, draft = mock_pair(noise=2.0)
    run = sd(target, draft, PROMPTS, target_temperature=0.0, draft_temperature=1.0, max_new_tokens=H)
    assert run.token_ids == [argmax_path(target, p) for p in PROMPTS]


def test_control_without_the_greedy_check_the_outputs_leave_the_path(monkeypatch):
    # The logits of a greedy row are read at T = 1: without the check, blocks are weighed and
    # bonuses drawn at T = 1, and the outputs are samples, not the path.
    monkeypatch.setattr(cycle, "greedy_verdict", lambda verdict, *_: verdict)
    target, draft = mock_pair(noise=2.0)
    want = [argmax_path(target, p) for p in PROMPTS]
    assert greedy(target, draft, [SMCSDModel(p) for p in PROMPTS], n_particles=4, block_size=4) != want


def test_zero_is_greedy_and_other_low_temperatures_are_refused():
    assert SMCConfig(target_temperature=0).target_temperature == 0
    with pytest.raises(ValueError, match="0 \\(greedy\\) or at least 0.01"):
        SMCConfig(target_temperature=0.001)
    with pytest.raises(ValueError, match="draft_temperature must be a finite number > 0"):
        SMCConfig(draft_temperature=0)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_at_temperature_zero_returns_ar_greedy_s_tokens(tiny_smcsd, method):
    prompts = [[5, 9, 13, 2, 40], [7, 7, 100, 3], [1, 2, 3]]
    cfg = SMCConfig(
        target_temperature=0, draft_temperature=0.5, max_new_tokens=10, n_particles=4, block_size=3
    )
    want = [g.token_ids for g in tiny_smcsd.generate_ids(prompts, method="ar", config=cfg)]
    assert [g.token_ids for g in tiny_smcsd.generate_ids(prompts, method=method, config=cfg)] == want

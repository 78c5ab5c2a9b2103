"""Top-k, top-p, min-p and a logit bias: SMC-SD's outputs follow the processed target, by enumeration.

The processed law is enumerated here from the mock target's table and ``processed`` (vLLM's
order), and the outputs' token marginals held to it at N = 32, as ``test_outputs_exact`` does
for the plain target. A mutant whose verification reads the unprocessed target (the draft still
processed) fails each case.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import EOS, V, distribution_marginal_tv, marginal_tv, mock_pair, smc

from smcsd_ppl.config import Sampling, SMCConfig
from smcsd_ppl.inference.flush import Flush
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.verification.processing import RowSampling, processed

PROMPT, H, RUNS = [1, 2], 4, 2000
TV_LIMIT = 0.05  # the marginals' sampling noise at RUNS is ~0.015
CASES = {
    "top_k": Sampling(top_k=2),
    "top_p": Sampling(top_p=0.7),
    "min_p": Sampling(min_p=0.3),
    "logit_bias": Sampling(logit_bias=((0, 1.5), (2, -1.0))),
    "all": Sampling(top_k=3, top_p=0.8, min_p=0.05, logit_bias=((1, 0.7),)),
}


def processed_target(lm, sampling: Sampling) -> dict:
    """Unnormalized weights of every output of at most ``H`` tokens under the processed target."""
    by_row = RowSampling.of([sampling], V, "cpu")
    weights = {}
    for n in range(1, H + 1):
        for seq in itertools.product(range(V), repeat=n):
            if EOS in seq[:-1] or (n < H and seq[-1] != EOS):
                continue
            lw = 0.0
            for t in range(n):
                logits = lm.next_logits(PROMPT + list(seq[:t])).float()[None]
                lw += float(
                    torch.log_softmax(
                        processed(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), by_row), -1
                    )[0, seq[t]]
                )
            weights[seq] = math.exp(lw)
    return weights


def outputs(sampling: Sampling, runs: int = RUNS, **cfg) -> list[list[int]]:
    target, draft = mock_pair()
    fields = dict(
        top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p, logit_bias=sampling.logit_bias
    )
    base = dict(n_particles=32, block_size=2, max_new_tokens=H, draft_temperature=1.0, seed=3) | fields
    programs = [SMCSDModel(PROMPT) for _ in range(runs)]
    return [r.token_ids for r in smc(target, draft, programs, **(base | cfg))]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "cut"), [(c, 0.3) for c in sorted(CASES)] + [("all", None)]
)  # default cut, none
def test_outputs_follow_the_processed_target(case, cut):
    target, _ = mock_pair()
    exact = processed_target(target, CASES[case])
    z = sum(exact.values())
    changed = distribution_marginal_tv(
        {k: w / z for k, w in exact.items()}, processed_target(target, Sampling()), H
    )
    assert changed > 2 * TV_LIMIT  # the case moves the law
    tv = marginal_tv(outputs(CASES[case], cut=cut), exact, H)
    print(f"{case}, cut {cut}: largest marginal TV {tv:.3f}")  # shown with pytest -s
    assert tv < TV_LIMIT, tv


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_control_verifying_against_the_unprocessed_target_fails(case, monkeypatch):
    def unprocessed(self, logits, rows, in_place=False):
        return processed(logits, self.target_t[rows].to(logits.device), torch.tensor(rows), None)

    monkeypatch.setattr(Flush, "temper", unprocessed)
    target, _ = mock_pair()
    got = outputs(CASES[case], runs=500, n_particles=8, cut=None)  # far off: fewer runs show it
    assert marginal_tv(got, processed_target(target, CASES[case]), H) > 2 * TV_LIMIT


def test_settings_out_of_range_are_refused_by_name():
    for bad, field in [({"top_k": -1}, "top_k"), ({"top_p": 0}, "top_p"), ({"min_p": 2}, "min_p")]:
        with pytest.raises(ValueError, match=field):
            SMCConfig(**bad)
    with pytest.raises(ValueError, match="logit_bias"):
        SMCConfig(logit_bias=((-1, 1.0),))

"""Pure SMC and verification math: ESS, resampling schemes, weights, speculative acceptance."""

from __future__ import annotations

import math

import pytest
import torch

from smcsd_ppl import smc
from smcsd_ppl.smc import resampling
from smcsd_ppl.verification import (
    block_log_weights,
    drawn_log_probs,
    power_log_normalizer,
    sample_probs,
    speculative_accept,
    token_log_probs,
)
from smcsd_ppl.verification.sampling import logsumexp


def test_ess_extremes_and_dead_particles():
    assert smc.ess(torch.zeros(8)) == pytest.approx(8.0)
    assert smc.ess(torch.tensor([0.0, -math.inf, -math.inf])) == pytest.approx(1.0)
    assert smc.ess(torch.full((4,), -math.inf)) == pytest.approx(4.0)  # all dead: uniform, no NaN
    assert smc.normalize(torch.tensor([float("nan"), 0.0])).tolist() == [0.0, 1.0]


def test_positive_infinite_weight_is_a_bug():
    with pytest.raises(ValueError, match=r"\+inf"):
        smc.normalize(torch.tensor([0.0, math.inf]))


def test_log_mean_exp():
    assert smc.log_mean_exp(torch.log(torch.tensor([1.0, 3.0]))) == pytest.approx(math.log(2.0))


@pytest.mark.parametrize("scheme", list(smc.RESAMPLERS))
def test_resampling_matches_weighted_means(scheme):
    g = torch.Generator().manual_seed(0)
    w = torch.tensor([0.5, 0.0, 0.2, 0.3])
    f = torch.tensor([1.0, 100.0, -2.0, 4.0])
    counts = torch.zeros(4)
    reps = 4000
    for _ in range(reps):
        a = smc.RESAMPLERS[scheme](w, g, 4)
        assert a.shape == (4,) and a.dtype == torch.long
        assert not (a == 1).any()  # zero weight is never chosen
        counts += torch.bincount(a, minlength=4)
    freq = counts / counts.sum()
    assert torch.allclose(freq, w, atol=0.015)
    assert float((freq * f).sum()) == pytest.approx(float((w * f).sum()), abs=0.08)


@pytest.mark.parametrize("scheme", ["systematic", "stratified", "residual"])
def test_low_variance_schemes_keep_deterministic_copies(scheme):
    # N * W_i = 2 exactly: systematic, stratified and residual must each give exactly 2 copies.
    g = torch.Generator().manual_seed(1)
    a = smc.RESAMPLERS[scheme](torch.tensor([0.5, 0.5, 0.0, 0.0]), g, 4)
    assert torch.bincount(a, minlength=4).tolist() == [2, 2, 0, 0]


def test_a_cumsum_ending_below_one_never_selects_a_dead_particle():
    # Three live particles whose float32 weights sum to just under 1, then two dead ones.
    w = torch.tensor([0.7, 0.2, 0.1, 0.0, 0.0])
    deficit = 1.0 - float(torch.cumsum(w.double(), 0)[-1])
    assert deficit > 0  # the setup is what the name says
    u = torch.tensor([0.0, 0.75, 1.0 - deficit / 2], dtype=torch.float64)
    assert resampling._inverse_cdf(w, u).tolist() == [0, 1, 2]


def test_unknown_scheme():
    with pytest.raises(ValueError, match="resampling"):
        smc.resample(torch.zeros(3), "bogus", torch.Generator())


def test_block_log_weights_masks_after_cut_and_adds_bonus():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.5, 0.5]]))
    logq = torch.log(torch.tensor([[0.25, 0.5, 0.1], [0.5, 0.5, 0.5]]))
    kept = torch.tensor([2, 3])
    lw = block_log_weights(logp, logq, kept, torch.tensor([0.3, 0.7]), torch.tensor([True, False]), 1.0)
    assert lw[0].item() == pytest.approx(math.log(2.0) + math.log(0.5) + 0.3)
    assert lw[1].item() == pytest.approx(0.0)
    lw2 = block_log_weights(logp, logq, kept, torch.zeros(2), torch.tensor([False, False]), 2.0)
    assert lw2[0].item() == pytest.approx(2 * math.log(0.125) - math.log(0.125))


def test_power_log_normalizer():
    logits = torch.log(torch.tensor([[0.2, 0.3, 0.5]]))
    assert power_log_normalizer(logits, 1.0, 1.0).item() == 0.0
    expect = math.log(0.2**2 + 0.3**2 + 0.5**2)
    assert power_log_normalizer(logits, 1.0, 2.0).item() == pytest.approx(expect, rel=1e-5)


def test_sample_probs_frequencies():
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).repeat(20000, 1)
    freq = torch.bincount(sample_probs(p, g), minlength=4).float() / 20000
    assert freq[1] == 0
    assert torch.allclose(freq, p[0], atol=0.015)


def test_speculative_accept_single_position_is_exact():
    # One drafted position over V=3: the emitted token must be distributed as p exactly.
    g = torch.Generator().manual_seed(4)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.2, 0.6])
    n = 40000
    drafts = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
    target_probs = p.expand(n, 2, 3).clone()
    n_acc, nxt = speculative_accept(target_probs, q.expand(n, 1, 3).clone(), drafts, g)
    emitted = torch.where(n_acc == 1, drafts[:, 0], nxt)
    freq = torch.bincount(emitted, minlength=3).float() / n
    assert torch.allclose(freq, p, atol=0.01)
    accept_rate = (n_acc == 1).float().mean().item()
    assert accept_rate == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.01)


def test_logsumexp_reads_the_far_tail_at_a_floor_and_keeps_empty_rows_empty():
    # Logits at a low temperature span hundreds of nats; rows of -inf (nothing allowed) stay -inf.
    x = torch.randn(5, 4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 60
    x[1, ::2] = -math.inf  # a mask
    x[2] = -math.inf
    x[3, 1:] = -1e4  # one term holds all the mass
    want = torch.logsumexp(x, -1)
    got = logsumexp(x.float(), -1).double()
    assert got[2] == -math.inf
    torch.testing.assert_close(got[[0, 1, 3, 4]], want[[0, 1, 3, 4]], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(logsumexp(x.float(), 1, keepdim=True).squeeze(1).double(), got)


def _near_certain_logits(rows: int = 4, vocab: int = 49152) -> torch.Tensor:
    """Logits over a real-sized vocabulary whose token 5 holds all but 1e-6 to 1e-4 of each row."""
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(rows, vocab, generator=g)
    logits[:, 5] += 25 + torch.arange(rows)  # 25 to 28 nats above the rest
    return logits


def test_a_near_certain_tokens_log_prob_is_exact_to_its_own_scale():
    """A float32 sum near 1 keeps about 1e-7 of the mass beside the top: a log p near 0 needs it apart."""
    logits = _near_certain_logits()
    tokens = torch.tensor([5, 5, 5, 7])  # the last: a token far from the top
    exact = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, None])[:, 0]
    got = token_log_probs(logits, tokens)
    assert got.dtype == torch.float32 and bool((exact[:3] > -0.02).all())
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=0.0)


def test_token_log_probs_at_ties_and_far_below_the_top():
    """Far below the top p is 0 (200 nats) or not a normal float (95 nats): read from the gap."""
    logits = torch.tensor([[0.0, 0.0, -200.0, -95.0, -math.inf]])
    got = token_log_probs(logits.expand(5, 5), torch.arange(5))
    assert got[:2].tolist() == pytest.approx([-math.log(2)] * 2)
    assert got[2:4].tolist() == pytest.approx([-200 - math.log(2), -95 - math.log(2)])
    assert got[4].item() == -math.inf


def test_a_drawn_tokens_log_prob_is_exact_to_its_own_scale():
    """``drawn_log_probs`` reads a distribution after mixing or masking, near 1 as far from it."""
    logits = _near_certain_logits()
    probs = torch.softmax(logits, -1)
    probs[2] = torch.tensor([0.3, 0.7] + [0.0] * (probs.shape[1] - 2))
    probs[3, 9] = 0.0  # a token the draw could not take
    tokens = torch.tensor([5, 5, 0, 9])
    exact = torch.log_softmax(logits.double(), -1)[:2, 5].tolist() + [math.log(0.3)]
    got = drawn_log_probs(probs, tokens)
    torch.testing.assert_close(
        got[:3].double(), torch.tensor(exact, dtype=torch.float64), rtol=1e-5, atol=0.0
    )
    assert got[3].item() == -math.inf

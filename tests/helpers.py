"""Exact enumeration of tiny mock LMs, shared by the statistical tests."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import torch
from scipy import stats

from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.inference.engine import BlockEngine

EOS = 3


def exact_target(lm: MockLM, prompt, horizon, *, temperature=1.0, alpha=1.0):
    """Unnormalized p_T^alpha of every output of at most ``horizon`` tokens, and Z."""
    weights = {}
    for n in range(1, horizon + 1):
        for seq in itertools.product(range(lm.vocab_size), repeat=n):
            if EOS in seq[:-1] or (n < horizon and seq[-1] != EOS):
                continue
            lw = 0.0
            for t in range(n):
                logp = torch.log_softmax(lm.next_logits(list(prompt) + list(seq[:t])) / temperature, -1)
                lw += alpha * float(logp[seq[t]])
            weights[seq] = math.exp(lw)
    return weights, sum(weights.values())


def chi_square_pvalue(samples: Counter, probs: dict) -> float:
    """Goodness of fit of sampled outputs to exact probabilities (rare cells pooled)."""
    n = sum(samples.values())
    keys = sorted(probs, key=probs.get, reverse=True)
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for k in keys:
        if probs[k] * n >= 5:
            observed.append(samples.get(k, 0))
            expected.append(probs[k] * n)
        else:
            rest_o += samples.get(k, 0)
            rest_e += probs[k] * n
    unknown = sum(c for k, c in samples.items() if k not in probs)
    assert unknown == 0, f"sampled outputs outside the support: {unknown}"
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    scale = sum(observed) / sum(expected)  # float rounding of the exact probabilities
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)


def total_variation(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


# The settings the exact tests were written for: the paper's algorithm (no cut), T_t = 1.
PAPER = dict(n_particles=4, block_size=4, draft_temperature=0.7, target_temperature=1.0, cut=None)


def engine(target: MockLM, draft: MockLM, **cfg) -> BlockEngine:
    return BlockEngine(target, draft, [EOS], SMCConfig(**{**PAPER, **cfg}))

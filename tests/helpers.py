"""Shared test support: exact enumeration of tiny mock LMs, the mock pair, test programs and
constraints, reference logits, regex contracts, and the command line run as a user runs it."""

from __future__ import annotations

import itertools
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import regex
import torch
from scipy import stats
from tiny import tokenizer

from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.config import DraftRecord, SMCConfig
from smcsd_ppl.engine.client import Engine
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.rows import RowStore
from smcsd_ppl.methods.sd import AcceptRule, SpeculativeRun, exact_accept, speculative_sampling
from smcsd_ppl.potentials import Constraint, token_bytes
from smcsd_ppl.potentials.contract import ConstraintContract
from smcsd_ppl.results import Generation

EOS = 3
V = 4
ROOT = Path(__file__).resolve().parents[1]


def scratch_logits(model, seq, n_last: int | None = None) -> torch.Tensor:
    """Logits ``[V]`` after ``seq`` from one plain forward of ``model``: no backend, cache or mask.

    ``n_last``: the logits ``[n_last, V]`` after each of the last ``n_last`` tokens instead.
    """
    with torch.inference_mode():
        logits = model(torch.tensor([list(seq)])).logits[0].float()
    return logits[-1] if n_last is None else logits[-n_last:]


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


def marginals(dist: dict, horizon: int) -> list[Counter]:
    """Per position, the distribution of the token there (-1: the output ended before it)."""
    out = [Counter() for _ in range(horizon)]
    for seq, p in dist.items():
        for j in range(horizon):
            out[j][seq[j] if j < len(seq) else -1] += p
    return out


def marginal_tv(outputs, exact: dict, horizon: int) -> float:
    """The largest TV, over positions, between the outputs' token marginals and the exact ones."""
    n = len(outputs)
    return distribution_marginal_tv(
        {k: c / n for k, c in Counter(map(tuple, outputs)).items()}, exact, horizon
    )


def distribution_marginal_tv(dist: dict, exact: dict, horizon: int) -> float:
    """``marginal_tv`` of a distribution over outputs (summing to 1) against unnormalized exact weights."""
    z = sum(exact.values())
    a, b = marginals(dist, horizon), marginals({k: v / z for k, v in exact.items()}, horizon)
    return max(
        0.5 * sum(abs(a[j].get(k, 0) - b[j].get(k, 0)) for k in set(a[j]) | set(b[j])) for j in range(horizon)
    )


# The settings the exact tests were written for: the paper's algorithm (no cut), T_t = 1.
PAPER = dict(n_particles=4, block_size=4, draft_temperature=0.7, target_temperature=1.0, cut=None)


def config(**cfg) -> SMCConfig:
    """``PAPER`` with overrides."""
    return SMCConfig(**{**PAPER, **cfg})


def mock_pair(noise: float = 0.8, rare_eos: bool = False) -> tuple[MockLM, MockLM]:
    """The mock target and a draft that differs from it (a perturbed copy, so p/q stays bounded)."""
    target = MockLM(V, seed=0, scale=1.5)
    perturbation = torch.randn(target.table.shape, generator=torch.Generator().manual_seed(7))
    draft = MockLM(table=target.table + noise * perturbation)
    if rare_eos:  # most outputs then reach the budget and carry bonus tokens
        for lm in (target, draft):
            lm.table[..., EOS] -= 2.5
    return target, draft


def run_rows(programs, store: RowStore, config: SMCConfig, eos=(EOS,), **kw) -> list[Generation]:
    """SMC-SD of ``programs`` as requests of an engine over ``store`` (``kw``: ``Engine.run``'s)."""
    return [t.wait() for t in Engine.over(store, list(eos)).run(list(programs), config, **kw)]


def smc(target, draft, programs, *, record: DraftRecord | None = None, eos=(EOS,), **cfg) -> list[Generation]:
    """SMC-SD of ``programs`` on a fresh row store over the mock pair, under ``config(**cfg)``."""
    return run_rows(programs, RowStore(target, draft), config(**cfg), eos, record=record)


def sd(target, draft, prompts, *, accept: AcceptRule = exact_accept, **cfg) -> SpeculativeRun:
    """A speculative loop (exact SD unless another ``accept`` rule) over the mock pair."""
    return speculative_sampling(RowStore(target, draft), config(**cfg), [EOS], prompts, accept=accept)


class NoOneZero(Constraint):
    """Outputs without the bigram (1, 0); EOS only once a 2 has appeared."""

    def next_mask(self, contexts):
        out = torch.ones(len(contexts), V, dtype=torch.bool)
        for i, c in enumerate(contexts):
            if not satisfies_prefix(c):
                out[i] = False
                continue
            if c and c[-1] == 1:
                out[i, 0] = False
            out[i, EOS] = 2 in c
        return out


def satisfies_prefix(seq) -> bool:
    body = list(seq)
    if EOS in body:
        return False
    return all(not (a == 1 and b == 0) for a, b in zip(body, body[1:]))


def satisfies(seq) -> bool:
    seq = list(seq)
    if seq and seq[-1] == EOS:
        return satisfies_prefix(seq[:-1]) and 2 in seq[:-1]
    return satisfies_prefix(seq)


class Twisted(SMCSDModel):
    """Twists towards outputs with many 2s; the final target must not change."""

    twists = 0

    async def step(self):
        await self.extend()
        if not self.finished:
            Twisted.twists += 1
            self.twist(0.7 * self.token_ids.count(2) - 0.3)


class Nothing(Constraint):
    def next_mask(self, contexts):
        return torch.zeros(len(contexts), V, dtype=torch.bool)


class DeadEnd(Constraint):
    """Only token 1 may come first; after it nothing is allowed (and EOS never)."""

    def next_mask(self, contexts):
        out = torch.zeros(len(contexts), V, dtype=torch.bool)
        for i, c in enumerate(contexts):
            if len(c) == 0:
                out[i, 1] = True
        return out


def forced_prefix(seq) -> bool:
    return all(t == (2 if i % 4 == 1 else 1) for i, t in enumerate(seq) if i % 4 in (1, 2))


class Forced(Constraint):
    """Tokens 2 then 1 at positions 1, 2 (and 5, 6, 9, 10, ...); anything elsewhere."""

    def next_mask(self, contexts):
        out = torch.ones(len(contexts), V, dtype=torch.bool)
        for i, c in enumerate(contexts):
            if not forced_prefix(c):  # off the forced tokens already: nothing may follow
                out[i] = False
            elif len(c) % 4 in (1, 2):
                out[i] = False
                out[i, 2 if len(c) % 4 == 1 else 1] = True
        return out


def regex_oracle(pattern, tok):
    """Brute-force matching of the tokens' bytes: (viable prefix, complete match)."""
    vocab, _ = token_bytes(tok)
    compiled = regex.compile(pattern.encode())

    def text(seq):
        parts = [vocab[t] for t in seq]
        return None if any(p is None for p in parts) else b"".join(parts)

    def viable(seq):
        data = text(seq)
        return data is not None and compiled.fullmatch(data, partial=True) is not None

    def complete(seq):
        data = text(seq)
        return data is not None and compiled.fullmatch(data) is not None

    return dict(viable=viable, complete=complete)


def regex_contract(make, pattern, **kw) -> ConstraintContract:
    """The contract of ``make(pattern, tokenizer, eos)`` on the tiny tokenizer, against brute force."""
    tok = tokenizer()
    eos = [tok.eos_token_id]
    return ConstraintContract(
        lambda: make(pattern, tok, eos), len(tok), eos, **regex_oracle(pattern, tok), **kw
    )


def run_cli(*args, stdin: bytes = b"", env: dict | None = None, timeout: float = 120):
    """Run ``python -m smcsd_ppl ARGS``; returns (exit status, stdout, stderr, seconds)."""
    base = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "smcsd_ppl", *args],
        input=stdin,
        capture_output=True,
        env=base | (env or {}),
        timeout=timeout,
        cwd=ROOT,
    )
    err = run.stderr.decode("utf-8", "replace")
    return run.returncode, run.stdout.decode("utf-8", "replace"), err, time.perf_counter() - start


def assert_one_line_error(code: int, err: str, needle: str) -> None:
    """Exit status 2, no traceback, and exactly one ``smcsd [COMMAND]: error:`` line, naming ``needle``."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if re.match(r"smcsd( [\w-]+)?: error: ", line)]
    assert len(lines) == 1 and needle in lines[0], err

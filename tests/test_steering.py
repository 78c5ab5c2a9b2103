"""Constrained-generation baselines (LLaMPPL, genlm-control, SMC-SD variants) on tiny models."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from smcsd_ppl.bench import constrained as compare
from smcsd_ppl.bench import steering
from smcsd_ppl.config import SMCConfig

PROMPT = "the quick brown fox"
PATTERN = r"[a-z ]{1,12}"
KW = dict(n_particles=4, max_new_tokens=8, temperature=1.0, seed=0)
LMS = steering.TokenLMs()  # the token-level runners' view of the tiny target, built once here

RUNNERS = {
    "llamppl_smc": partial(steering.llamppl_smc, lms=LMS),
    "llamppl_masked": partial(steering.llamppl_smc, masked=True, lms=LMS),
    "genlm_awrs": partial(steering.genlm_smc, lms=LMS),
    "genlm_direct": partial(steering.genlm_smc, sampler="direct", lms=LMS),
    "genlm_critic": partial(steering.genlm_smc, sampler="critic", lms=LMS),
    "smcsd_filtered": steering.smcsd_filtered,
    "smcsd_proposal": steering.smcsd_constrained,
    "smcsd_critic": partial(steering.smcsd_constrained, mode="critic"),
    "smcsd_plain": steering.smcsd_plain,
}
# Runners whose particles can only be valid (the constraint shapes every token).
ALWAYS_VALID = {"llamppl_masked", "genlm_awrs", "genlm_direct", "smcsd_proposal"}


@pytest.fixture(scope="module")
def ctx(tiny_smcsd):
    """The tiny pair's run context, as the runners take it."""
    return tiny_smcsd.context()


def test_the_registry_names_every_runner_once():
    assert set(steering.STEERING_METHODS) == set(RUNNERS)
    assert steering.SMCSD_STEERING + steering.TOKEN_STEERING == tuple(steering.STEERING_METHODS)
    assert steering.STEERING_METHODS["genlm_direct"].keywords == {"sampler": "direct"}


@pytest.mark.parametrize("name", ["llamppl_smc", "genlm_direct"])
def test_token_level_runs_reproduce_and_leave_the_global_generators_alone(ctx, task, name):
    import random

    import numpy as np

    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    first = RUNNERS[name](ctx, PROMPT, task, **KW)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert (np.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]
    again = RUNNERS[name](ctx, PROMPT, task, **KW)
    assert again.particle_ids == first.particle_ids and again.log_weights == first.log_weights
    assert len(LMS.built) == 1  # one AsyncTransformer for the pair, kept by its owner


@pytest.fixture(scope="module")
def task(tiny_smcsd):
    """``PATTERN`` as a task constraint on the tiny pair's tokenizer."""
    return pattern_task(tiny_smcsd)


def pattern_task(pair):
    return steering.TaskConstraint(pair.tokenizer, pair.eos_token_ids, PATTERN)


def check_record(pair, rec, n, max_new_tokens):
    assert len(rec.texts) == len(rec.particle_ids) == len(rec.valid) == len(rec.log_weights) == n
    assert all(rec.texts[i] == pair.decode(p) for i, p in enumerate(rec.particle_ids))
    assert all(len(p) <= n_tok <= max_new_tokens for p, n_tok in zip(rec.particle_ids, rec.lengths))
    assert not any(set(p) & set(pair.eos_token_ids) for p in rec.particle_ids)  # EOS dropped
    assert rec.seconds > 0
    task = pattern_task(pair)  # validity is the weight and the task's own check, recomputed here
    assert rec.valid == [math.isfinite(w) and task.check(t) for w, t in zip(rec.log_weights, rec.texts)]
    assert rec.ess is not None and 0.0 <= rec.ess <= n + 1e-6
    if rec.chosen >= 0:
        assert math.isfinite(rec.log_weights[rec.chosen])
        assert rec.text == rec.texts[rec.chosen] and rec.token_ids == rec.particle_ids[rec.chosen]
        assert rec.log_z is not None and rec.log_z < math.inf
    else:
        assert rec.text == "" and rec.token_ids == [] and rec.log_z == -math.inf and rec.message
    for ok, w in zip(rec.valid, rec.log_weights):
        assert not ok or math.isfinite(w)  # a zero-weight particle never counts as valid


@pytest.mark.parametrize("name", list(RUNNERS))
def test_runner_returns_well_formed_record(tiny_smcsd, ctx, task, name):
    rec = RUNNERS[name](ctx, PROMPT, task, **KW)
    assert rec.method == name
    check_record(tiny_smcsd, rec, KW["n_particles"], KW["max_new_tokens"])
    if name in ALWAYS_VALID:
        assert rec.validity == 1.0 and rec.selected_valid
        assert all(task.check(t) for t in rec.texts)


@pytest.mark.parametrize("name", ["smcsd_proposal", "genlm_awrs", "llamppl_masked"])
def test_genlm_potential_as_constraint(tiny_smcsd, ctx, name):
    from genlm.control import BoolFSA

    rec = RUNNERS[name](ctx, PROMPT, BoolFSA.from_regex(PATTERN), **KW)
    check_record(tiny_smcsd, rec, KW["n_particles"], KW["max_new_tokens"])
    assert rec.validity == 1.0
    assert all(pattern_task(tiny_smcsd).check(t) for t in rec.texts)


class Only(steering.TaskConstraint):
    """Valid texts are exactly those in ``accepted``."""

    def __init__(self, pair, accepted):
        super().__init__(pair.tokenizer, pair.eos_token_ids, PATTERN)
        self.accepted = set(accepted)

    def check(self, text):
        return text.strip() in self.accepted


def test_filtered_counts_valid_particles(tiny_smcsd, ctx):
    plain = steering.smcsd_plain(ctx, PROMPT, PATTERN, **KW)
    again = steering.smcsd_plain(ctx, PROMPT, PATTERN, **KW)
    assert again.texts == plain.texts  # seeded: the filter sees the same particles
    target = plain.texts[0].strip()
    rec = steering.smcsd_filtered(ctx, PROMPT, Only(tiny_smcsd, [target]), **KW)
    expected = [t.strip() == target for t in plain.texts]
    assert rec.texts == plain.texts and rec.valid == expected
    assert rec.validity == sum(expected) / len(expected)
    assert rec.selected_valid and rec.text.strip() == target
    w = torch.tensor(plain.log_weights, dtype=torch.float64)
    share = torch.logsumexp(w[torch.tensor(expected)], 0) - torch.logsumexp(w, 0)
    assert rec.log_z == pytest.approx(plain.log_z + float(share))

    none = steering.smcsd_filtered(ctx, PROMPT, Only(tiny_smcsd, []), **KW)
    assert none.validity == 0.0 and none.chosen == -1 and none.text == "" and none.log_z == -math.inf


def test_compare_rows_and_length_matched_plain(tiny_smcsd):
    tasks = [compare.Task("tiny", PROMPT, PATTERN)]
    seen = []
    rows = compare.compare_constrained(
        tiny_smcsd,
        tasks,
        ["smcsd_proposal", "smcsd_plain", "genlm_awrs"],
        # the paper's whole blocks: random weights would cut at every position (default: 0.3)
        SMCConfig(
            n_particles=4,
            block_size=3,
            max_new_tokens=8,
            draft_temperature=1.0,
            target_temperature=1.0,
            cut=None,
        ),
        on_run=lambda task, method, rec: seen.append((method, rec)),
    )
    assert [(r.task, r.method) for r in rows] == [
        ("tiny", "smcsd_proposal"),
        ("tiny", "smcsd_plain"),
        ("tiny", "genlm_awrs"),
    ]
    recs = dict(seen)
    # The plain reference emits exactly as many tokens as the constrained run's particles did.
    assert recs["smcsd_plain"].lengths == [round(recs["smcsd_proposal"].tokens)] * 4
    for r in rows:
        assert r.runs == 1 and r.tokens_per_second > 0
    assert rows[0].validity == 1.0 and rows[0].output_validity == 1.0
    assert rows[0].loglik_per_token < 0
    # The hook on the embeddings counts what the backend counts, and token-level SMC pays one
    # target forward per token where SMC-SD pays one per block.
    for method in ("smcsd_proposal", "smcsd_plain"):
        assert recs[method].target_forwards == recs[method].target_calls
    assert rows[2].target_forwards >= max(recs["genlm_awrs"].lengths) > rows[0].target_forwards
    ratios = compare.speed_ratios(rows)
    assert set(ratios["tiny"]) == {"smcsd_plain", "genlm_awrs"}
    with pytest.raises(ValueError, match="unknown methods"):
        compare.compare_constrained(tiny_smcsd, tasks, ["nope"])


@pytest.mark.slow
def test_compare_constrained_cli_default_model(capsys):
    from smcsd_ppl.cli import main

    argv = ["compare-constrained", "--tasks", "date", "-n", "4", "--max-new-tokens", "16"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    for method in compare.METHODS:
        assert f"| date | {method} |" in out
    # Quality beside speed, for every method; no ratio from a single run.
    quality = next(line for line in out.splitlines() if line.startswith("date: smcsd_proposal "))
    assert all(f"{m} " in quality for m in compare.METHODS) and "log p/tok" in quality and "log Z" in quality
    assert "speed ratios need --repeats 2" in out and "tokens/s =" not in out
    assert "Token(token_id" not in captured.err  # a library's warning, once and without the prompt


def row(method, valid, tps):
    return compare.CompareRow(method, "t", valid, valid, tps, 8, 1, -1.0, -2.0, 3.0, 9, 2, "x")


def test_the_summary_gives_no_ratio_against_a_method_without_valid_output():
    rows = [row("smcsd_proposal", 1.0, 20.0), row("llamppl_masked", 1.0, 10.0), row("llamppl_smc", 0.0, 40.0)]
    lines = compare.summaries(rows, repeats=3)
    assert "llamppl_smc 0% valid" in lines[0]  # its quality is shown
    assert lines[1] == "t: smcsd_proposal tokens/s = 2.00x llamppl_masked"  # but no ratio against it
    assert compare.summaries(rows, repeats=1)[1].startswith("t: speed ratios need --repeats 2")


def test_task_checks_judge_meaning_too():
    assert compare.is_calendar_date("1969-07-20") and not compare.is_calendar_date("1500-15-25")
    assert compare.is_person('{"name": "Ada", "age": 36}') and not compare.is_person(
        '{"name": "Ada", "age": "x"}'
    )

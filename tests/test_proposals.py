"""Proposals as the schedule picks them: retrieval where it pays, nothing extra where it cannot."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers import mock_pair, smc

from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.config import DraftRecord, SMCConfig
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.schedule import DraftSchedule, learned, schedule_from
from smcsd_ppl.proposals.blocks import RequestIndex, RowProposal

BOTH = ("draft", "retrieval")


def test_unknown_proposals_are_probed_side_by_side_only_where_retrieval_knows_something():
    fresh = schedule_from(DraftRecord(), 8, 6, True, 0.4, BOTH, 0.05)
    assert fresh.advanced(retrievable=True).plan == (("draft", 4), ("retrieval", 8))
    assert fresh.advanced(retrievable=False).plan == (("draft", 4),)  # exactly as before
    # Rows cost more: the draft is still probed (a seed's first cycle is the same on every
    # machine), and retrieval beside it.
    costly = schedule_from(DraftRecord(), 8, 6, True, 0.4, BOTH, 0.1)
    assert costly.advanced(retrievable=True).plan == (("draft", 4), ("retrieval", 8))


def test_the_schedule_runs_the_proposal_that_pays_with_n_particles_where_weights_differ():
    weak_draft = DraftSchedule(8, 6, plain=True, cost=0.4, passed=1, failed=20, candidates=BOTH)
    weak_draft = weak_draft.advanced()  # nothing to retrieve: the target alone, one particle
    assert weak_draft.plan == (("target", 0),) and weak_draft.n_particles() == 1
    copying = DraftSchedule(8, 6, True, 0.4, 1, 20, candidates=BOTH, others=(("retrieval", 8.0, 0.2),))
    plan = copying.advanced(retrievable=True)
    # The target checks each retrieved token: a plain request's weights stay equal, one particle
    # will do; any other request's weights differ, which needs its N particles.
    assert plan.plan == (("retrieval", 8),) and plan.n_particles() == 1
    steered = replace(copying, plain=False).advanced(retrievable=True)
    assert steered.plan == (("retrieval", 8),) and steered.n_particles() == 6
    poor = DraftSchedule(
        8, 6, True, 0.4, 1, 20, candidates=BOTH, others=(("retrieval", 0.5, 8.0),), row_cost=0.1
    )
    assert poor.advanced(retrievable=True).plan == (("target", 0),)
    faded = poor
    for _ in range(20):  # evidence fades while unused: retrieval is probed again later
        faded = faded.advanced(retrievable=False)
    assert faded.advanced(retrievable=True).plan == (("retrieval", 8),)


def test_a_record_keeps_a_rate_per_proposal():
    record = DraftRecord(4.0, 1.0, (("retrieval", 10.0, 2.0),))
    schedule = schedule_from(record, 8, 4, True, 0.4, BOTH, 0.1)
    assert schedule.others == (("retrieval", pytest.approx(8 * 10 / 12), pytest.approx(8 * 2 / 12)),)
    seen = schedule.advanced(retrievable=True).observed_kind("retrieval", [6], [True])
    folded = learned(record, seen)
    assert folded.rate_of("retrieval")[0] > 0.8 * 10 and folded.rate_of("mixture") == (0.0, 0.0)
    with pytest.raises(ValueError, match="rates"):
        DraftRecord(rates=(("beam", 1.0, 1.0),))
    with pytest.raises(ValueError, match="proposal"):
        SMCConfig(proposal="beam")


def test_the_index_holds_the_prompt_and_what_was_written():
    index = RequestIndex([5, 6, 7, 1, 2])
    assert index.continues([9, 5, 6]) and not index.continues([9, 2])
    index.feed([5, 6, 7, 1, 2], [3, 4])
    assert index.continues([1, 2]) and index.continues([2, 3])
    with pytest.raises(ValueError, match="index"):
        RowProposal("retrieval")


def copying_pair():
    """A target that walks a cycle of tokens, a draft that knows nothing of it, and a prompt on it."""
    cycle = [4, 2, 6, 5, 0, 7, 1]
    table = torch.zeros(8, 8, 8)
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        table[:, a, b] = 10.0  # p(next on the cycle) > 0.999
    target = MockLM(table=table, max_length=128)
    noise = torch.randn(table.shape, generator=torch.Generator().manual_seed(9))
    draft = MockLM(table=noise, max_length=128)
    return target, draft, (cycle * 5)[:32]


def test_a_request_that_copies_runs_long_retrieved_blocks():
    target, draft, prompt = copying_pair()
    target.stats.reset()
    draft.stats.reset()
    (out,) = smc(target, draft, [SMCSDModel(prompt)], n_particles=4, block_size=8, max_new_tokens=40, cut=0.3)
    assert len(out.token_ids) == 40
    assert target.stats.calls <= 1 + 40 / 4  # >= 4 tokens per target call (prefill included)
    assert max(out.smc.draft_lengths) == 8
    assert draft.stats.calls <= 8  # the prefill and the probe's draft forwards, no more


def test_nothing_to_retrieve_costs_nothing_extra(monkeypatch):
    # Where retrieval never knows a continuation, auto runs exactly what the draft alone runs.
    monkeypatch.setattr(RequestIndex, "continues", lambda self, context, min_match=2: False)
    target, draft = mock_pair()
    runs = {}
    for proposal in ("auto", "draft"):
        target.stats.reset()
        out = smc(target, draft, [SMCSDModel([1, 2])], n_particles=4, cut=0.3, proposal=proposal, seed=1)
        runs[proposal] = (out[0].token_ids, target.stats.calls)
    assert runs["auto"] == runs["draft"]


def test_the_copy_benchmark_reads_spec_bench_categories_and_our_edits(tmp_path):
    import json

    from smcsd_ppl.bench.copying import CategoryRow, copy_prompts, markdown_table, plot
    from smcsd_ppl.bench.editing import editing_prompts

    path = tmp_path / "question.jsonl"
    lines = [
        {"question_id": i, "category": c, "turns": [f"{c} prompt {i}"]}
        for i, c in enumerate(["summarization", "rag", "translation", "qa"] * 3)
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    prompts = copy_prompts(path, 2, 20)
    assert len(prompts) == 26 and len(editing_prompts()) >= 20
    assert [p.category for p in prompts[:6]] == ["summarization"] * 2 + ["rag"] * 2 + ["translation"] * 2
    with pytest.raises(ValueError, match="no prompts of"):
        (tmp_path / "qa.jsonl").write_text(json.dumps(lines[3]))
        copy_prompts(tmp_path / "qa.jsonl", 1, 0)
    rows = [CategoryRow(m, "rag", 2.0, x, c, -0.5, 3) for m, x, c in (("ar", 1.0, 1.0), ("smcsd", 1.4, 3.2))]
    assert "| rag | smcsd | 2.0 | 1.40x | 3.20 |" in markdown_table(rows)
    assert plot(rows, tmp_path / "p.png").stat().st_size > 0


def checked_blocks():
    """20,000 rows retrieve 2 tokens from r and the target checks them (alpha = 2, token 3 forbidden).

    Returns the verdict, each row's first emitted token and the one after, and p~ (the
    normalized power times the factor) and its log Z at the three positions.
    """
    from smcsd_ppl.proposals.blocks import Retrieval
    from smcsd_ppl.verification import BlockBatch, verify_blocks

    n, k, alpha, g = 20_000, 2, 2.0, torch.Generator().manual_seed(5)
    logits = torch.randn(1, k + 1, 4, generator=g).expand(n, k + 1, 4)
    factor = torch.tensor([0.0, 0.0, 0.0, -math.inf]).expand(n, k + 1, 4)
    r = torch.tensor([[0.6, 0.3, 0.1, 0.0], [0.1, 0.2, 0.7, 0.0]])  # far from p~
    retrieval, tokens, logq = Retrieval([], [], 4), [], []
    for j in range(k):
        t, log_r = retrieval.draw(list(range(n)), r[j].expand(n, 4), torch.rand(n, generator=g))
        tokens.append(t)
        logq.append(log_r)
    batch = BlockBatch(
        tokens=torch.tensor(tokens).T,
        draft_logq=torch.tensor(logq).T,
        limit=torch.full((n,), k),
        stops=torch.zeros(n, dtype=torch.bool),
        dead=torch.zeros(n, dtype=torch.bool),
        lead_log_w=torch.zeros(n),
        draft_probs=r.expand(n, k, 4),
        log_factor=factor,
        retrieved=torch.ones(n, dtype=torch.bool),
        checks=torch.tensor([retrieval.checks[i] for i in range(n)], dtype=torch.float64),
    )
    v = verify_blocks(logits, batch, torch.rand(n, generator=g), alpha=alpha)
    emitted = torch.cat([batch.tokens, v.bonus[:, None]], 1)
    first = torch.where(v.kept > 0, emitted[:, 0], v.bonus)
    second = torch.where(v.kept > 1, emitted[:, 1], v.bonus)
    tilted = alpha * torch.log_softmax(logits[0], -1) + factor[0]
    return v, first, second, torch.softmax(tilted, -1), torch.logsumexp(tilted, -1)


def law(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=4).double() / len(tokens)


@pytest.mark.parametrize("residual", [True, False])
def test_the_target_checks_retrieved_tokens_so_each_follows_it_exactly(residual, monkeypatch):
    # The check keeps a retrieved x with chance min(1, p~(x) / r(x)), and the bonus after the
    # first refusal comes from the residual: each emitted token follows p~ (TV noise ~0.01 at
    # 20,000 rows) and weighs log Z where it was drawn. The mutant (the bonus after a refusal
    # from p~, not the residual (p~ - r)+) moves the first token's law by about 0.2.
    from smcsd_ppl.verification import smcsd as verification

    if not residual:
        real = verification.checked_retrieval

        def mutant(*args):
            first, logq, spare = real(*args)
            return first, logq, torch.zeros_like(spare)  # no residual: the caller draws from p~

        monkeypatch.setattr(verification, "checked_retrieval", mutant)
    v, first, second, p, log_z = checked_blocks()
    tv_first = 0.5 * float((law(first) - p[0].double()).abs().sum())
    went_on = v.kept > 0
    tv_second = 0.5 * float((law(second[went_on]) - p[1].double()).abs().sum())
    print(f"residual={residual}: TV of the first token {tv_first:.3f}, of the second {tv_second:.3f}")
    if not residual:
        assert tv_first > 0.1
        return
    assert tv_first < 0.02 and tv_second < 0.02 and not bool((first == 3).any())
    expect = torch.cumsum(log_z, 0)[v.kept]  # log Z at each emitted position
    assert torch.allclose(v.log_w, expect, atol=1e-5)
    assert bool(v.has_bonus.all()) and 0 < float(went_on.float().mean()) < 1

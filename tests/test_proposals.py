"""Proposals as the schedule picks them: retrieval where it pays, nothing extra where it cannot."""

from __future__ import annotations

import math

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


def test_the_schedule_runs_the_proposal_that_pays_and_keeps_n_particles_for_it():
    weak_draft = DraftSchedule(8, 6, plain=True, cost=0.4, passed=1, failed=20, candidates=BOTH)
    weak_draft = weak_draft.advanced()  # nothing to retrieve: the target alone, one particle
    assert weak_draft.plan == (("target", 0),) and weak_draft.n_particles() == 1
    copying = DraftSchedule(8, 6, True, 0.4, 1, 20, candidates=BOTH, others=(("retrieval", 8.0, 0.2),))
    plan = copying.advanced(retrievable=True)
    assert plan.plan == (("retrieval", 8),) and plan.n_particles() == 6  # weights need N particles
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
    assert max(out.info.draft_lengths) == 8
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


@pytest.mark.parametrize("stop", [False, True])
def test_a_retrieval_rows_weight_divides_by_the_mixture_with_the_target(stop):
    # The weight formula itself, at alpha = 2: kept tokens and a bonus after a stop for the target
    # weigh p^alpha / ((1 - s) r + s p~); a bonus after the block's length weighs log Z. Mutants:
    # log q taken as log r fails both cases, the stop's bonus weighed as log Z fails the second.
    from smcsd_ppl.verification import BlockBatch, verify_blocks

    alpha, s, k = 2.0, 1 / 16, 2
    logits = torch.randn(1, k + 1, 4, generator=torch.Generator().manual_seed(5))
    r = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.0, 0.25, 0.75, 0.0]]])
    tokens = torch.tensor([[1, 2]])
    batch = BlockBatch(
        tokens=tokens,
        draft_logq=r[0, [0, 1], [1, 2]].log()[None],
        limit=torch.tensor([1 if stop else k]),
        stops=torch.tensor([False]),
        dead=torch.tensor([False]),
        lead_log_w=torch.zeros(1),
        draft_probs=r,
        target_share=torch.tensor([s]),
        stopped_at=torch.tensor([1 if stop else -1]),
    )
    verdict = verify_blocks(
        logits, batch, torch.rand(1, generator=torch.Generator().manual_seed(0)), alpha=alpha
    )
    tilted = alpha * torch.log_softmax(logits[0], -1)  # [k+1, V]
    p = torch.softmax(tilted, -1)  # the normalized power p~

    def term(j, x):
        rx = float(r[0, j, x]) if j < k else 0.0
        return float(tilted[j, x]) - math.log((1 - s) * rx + s * float(p[j, x]))

    kept = 1 if stop else k
    bonus = int(verdict.bonus[0])
    expect = sum(term(j, int(tokens[0, j])) for j in range(kept))
    expect += term(kept, bonus) if stop else float(torch.logsumexp(tilted[kept], -1))
    assert int(verdict.kept[0]) == kept and bool(verdict.has_bonus[0])
    assert float(verdict.log_w[0]) == pytest.approx(expect, abs=1e-5)

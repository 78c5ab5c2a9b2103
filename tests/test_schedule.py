"""Adaptive drafting: the draft length a request picks, and what a pair remembers of its draft."""

from __future__ import annotations

import dataclasses
import json

import pytest
import tiny
import torch
from helpers import mock_pair, smc

from smcsd_ppl import SMCSD, SMCConfig
from smcsd_ppl.backends.hf import HFBatchedLM
from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.bench.fidelity import MixedDraft
from smcsd_ppl.config import DraftRecord
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.schedule import PRIOR_POSITIONS, DraftSchedule, best_length, learned, schedule_from


def test_best_length_follows_the_pass_rate_and_the_cost():
    assert best_length(1.0, 0.4, 8) == 8  # a draft the cut never stops: the longest block
    assert best_length(0.0, 0.4, 8) == 0  # one it always stops: the target alone
    assert best_length(0.2, 0.4, 8) == 0
    assert 0 < best_length(0.8, 0.4, 8) < 8
    assert best_length(0.8, 0.05, 8) > best_length(0.8, 0.4, 8)  # cheaper drafts draft further


def test_a_plain_request_probes_with_n_particles_then_drafts_with_n_or_decodes_alone():
    good = DraftSchedule(8, 6, plain=True, cost=0.4).advanced()
    assert (good.length, good.n_particles()) == (4, 6)  # a probe's kept tokens carry weights
    good = good.observed([4], [False]).advanced()
    assert (good.length, good.n_particles()) == (8, 6)
    weak = DraftSchedule(8, 6, plain=True, cost=0.4).advanced().observed([0], [True]).advanced()
    assert (weak.length, weak.n_particles()) == (0, 1)
    assert weak.alone and weak.advanced().length == 0
    program = DraftSchedule(8, 6, plain=False, cost=0.4).advanced().observed([0], [True]).advanced()
    assert (program.length, program.n_particles()) == (0, 6)  # conditions need every particle


def test_a_record_is_a_value_requests_start_from():
    record = DraftRecord(passed=2.0, failed=30.0)
    first = schedule_from(record, 8, 4, True, 0.4)
    assert first.passed + first.failed == pytest.approx(PRIOR_POSITIONS)  # scaled to the prior's weight
    assert first.advanced().length == 0  # known not to pay: alone from the start
    assert schedule_from(record, 8, 4, True, 0.4) == first  # nothing in the record moved
    assert schedule_from(DraftRecord(), 8, 4, True, 0.4).advanced().length == 4  # nothing known: probe
    seen = first.advanced().observed([3, 2], [True, False])
    assert learned(record, seen) == DraftRecord(0.8 * 2.0 + 5, 0.8 * 30.0 + 1)
    with pytest.raises(ValueError, match="passed"):
        DraftRecord(passed=-1.0)


def test_requests_known_to_decode_alone_skip_the_draft_entirely():
    target, draft = mock_pair()
    before = draft.stats.calls
    programs = [SMCSDModel([1, 2]) for _ in range(3)]
    results = smc(
        target,
        draft,
        programs,
        max_new_tokens=6,
        n_particles=4,
        block_size=2,
        cut=0.25,
        record=DraftRecord(0.0, 50.0),
        proposal="draft",  # retrieval needs no draft either, but runs N particles
    )
    assert draft.stats.calls == before  # not even prefilled
    assert any(r.smc.draft_lengths for r in results) and not any(any(r.smc.draft_lengths) for r in results)
    assert all(len(r.smc.particles) == 1 for r in results if r.smc.draft_lengths)  # one particle decodes


def test_a_record_with_its_row_cost_gives_a_seed_the_same_answer_whatever_the_machine():
    answers, lengths = {}, {}
    for record_cost in (0.05, None):  # None: each machine's own r decides
        for machine_cost in (0.0, 0.5):
            target, draft = mock_pair()
            target.row_position_cost = machine_cost
            results = smc(
                target,
                draft,
                [SMCSDModel([1, 2]) for _ in range(6)],
                max_new_tokens=10,
                n_particles=4,
                block_size=4,
                cut=0.25,
                seed=3,
                record=DraftRecord(6.0, 2.0, row_cost=record_cost),
                proposal="draft",
            )
            answers[record_cost, machine_cost] = [r.token_ids for r in results]
            lengths[record_cost, machine_cost] = [r.smc.draft_lengths for r in results]
    assert answers[0.05, 0.0] == answers[0.05, 0.5] and lengths[0.05, 0.0] == lengths[0.05, 0.5]
    assert any(any(n) for n in lengths[0.05, 0.0])  # it drafts, as r = 0.05 calls for
    # Without the record's r the machines choose differently, and so answer differently.
    assert lengths[None, 0.0] != lengths[None, 0.5] and answers[None, 0.0] != answers[None, 0.5]


def test_a_record_survives_a_manifest_and_a_learned_record_keeps_its_row_cost():
    record = DraftRecord(4.0, 1.0, (("retrieval", 2.0, 1.0),), row_cost=0.05)
    assert DraftRecord.from_json(json.loads(json.dumps(record.as_json()))) == record
    seen = schedule_from(record, 8, 4, True, 0.4).advanced().observed([3], [True])
    assert learned(record, seen).row_cost == 0.05
    assert schedule_from(record, 8, 4, True, 0.4, row_cost=0.9).row_cost == 0.05  # the record's wins
    assert schedule_from(DraftRecord(), 8, 4, True, 0.4, row_cost=0.9).row_cost == 0.9
    for bad in ({"passed": 1, "speed": 2}, {"rates": [["retrieval", 1]]}, {"row_cost": -1}, [1, 2]):
        with pytest.raises(ValueError, match="(?i)record"):
            DraftRecord.from_json(bad)


def test_a_draft_that_does_not_pay_is_off_for_the_rest_of_a_plain_request():
    # A pass rate that pays with N rows against N rows, not against one row alone: no prefill.
    record = DraftRecord(453.0, 189.0, row_cost=0.05)
    plain = schedule_from(record, 8, 8, True, 0.2).advanced()
    assert plain.plan == (("target", 0),) and plain.draft_off
    program = schedule_from(record, 8, 8, False, 0.2).advanced()  # N rows either way: it drafts
    assert program.plan[0][0] == "draft" and not program.draft_off


def test_with_the_target_as_draft_the_cut_never_fires_and_target_calls_match_the_paper():
    target, _ = mock_pair()
    calls = {}
    for cut in (0.05, None):
        target.stats.reset()
        results = smc(
            target,
            MockLM(table=target.table.clone()),
            [SMCSDModel([1, 2]) for _ in range(8)],
            max_new_tokens=12,
            n_particles=3,
            block_size=3,
            draft_temperature=1.0,
            cut=cut,
            seed=1,
            record=DraftRecord(passed=8.0),  # the pair has seen this draft before
            proposal="draft",  # the draft's cut, not what retrieval adds
        )
        calls[cut] = target.stats.calls
        if cut is not None:
            assert all(set(r.smc.draft_lengths) <= {3} for r in results) and any(
                r.smc.draft_lengths for r in results
            )
    assert calls[0.05] == calls[None]


def test_a_mixture_draft_is_the_target_at_lam_1_and_the_draft_at_lam_0():
    target_model, draft_model = tiny.llama(seed=0), tiny.llama(seed=5, layers=1)
    ids = torch.tensor([[1, 2, 3]])
    for lam, reference in ((1.0, target_model), (0.0, draft_model)):
        mixed = MixedDraft(HFBatchedLM(target_model), HFBatchedLM(draft_model), lam, 0.7)
        out = mixed.prefill([[5, 6]])
        ext = mixed.extend(ids)
        with torch.inference_mode():
            ref = reference(torch.tensor([[5, 6, 1, 2, 3]])).logits.float()
        torch.testing.assert_close(torch.softmax(out / 0.7, -1), torch.softmax(ref[:, 1] / 0.7, -1))
        torch.testing.assert_close(torch.softmax(ext / 0.7, -1), torch.softmax(ref[:, 2:] / 0.7, -1))
    with pytest.raises(ValueError, match="lam"):
        MixedDraft(HFBatchedLM(target_model), HFBatchedLM(draft_model), 1.5, 0.7)


def test_the_fidelity_map_runs_end_to_end():
    from smcsd_ppl.batch import Prompt
    from smcsd_ppl.bench.fidelity import fidelity_map

    pair = SMCSD(*tiny.pair())
    prompts = [
        Prompt("a", "the quick brown fox", "misc", "dog"),
        Prompt("b", "once upon a time", "misc", "girl"),
    ]
    base = dataclasses.replace(SMCConfig(), max_new_tokens=6, n_particles=2, block_size=2)
    points = fidelity_map(pair, prompts, [(1.0, 2, 2, 0.3), (0.0, 2, 2, None)], base)
    assert [p.lam for p in points] == [1.0, 0.0]
    assert points[0].agreement == 1.0 and points[1].agreement < 1.0  # the target itself, then the draft
    assert all(p.tokens_per_target_call > 0 for p in points)


def test_a_collapsed_request_says_so():
    # 8 tokens, no EOS, a draft unrelated to the target: whole blocks leave one particle a cycle.
    target, far = MockLM(8, seed=0, scale=2.0), MockLM(8, seed=1, scale=2.0)
    flags = {}
    for cut in (None, 0.25):
        programs = [SMCSDModel([1, 2]) for _ in range(20)]
        cfg = dict(max_new_tokens=16, n_particles=8, draft_temperature=1.0, cut=cut)
        results = smc(target, far, programs, eos=[], record=DraftRecord(passed=8.0), **cfg)  # drafts at once
        flags[cut] = sum(r.smc.collapsed for r in results)
    assert flags[None] >= 15  # the paper's algorithm collapses, and says so
    assert flags[0.25] == 0  # the cut soon leaves such a draft out

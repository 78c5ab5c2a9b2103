"""MineDraft schedule: exact on the mock LM, same tokens threaded or not, sane on tiny Llamas."""

from __future__ import annotations

from collections import Counter

import pytest
import tiny
from helpers import EOS, chi_square_pvalue, config, exact_target, mock_pair

from smcsd_ppl.api import SMCSD
from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.inference.rows import RowStore
from smcsd_ppl.methods.minedraft import minedraft_sampling, side_loops, split_balanced
from smcsd_ppl.methods.sd import SpeculativeLoop

PROMPT, H = [1, 2], 4


def mock_sides(**cfg):
    """Two speculative loops over separate mock backends with the same tables, different seeds."""
    target, draft = mock_pair()
    sides = []
    for seed in (1, 2):
        store = RowStore(MockLM(table=target.table), MockLM(table=draft.table))
        settings = dict(block_size=2, max_new_tokens=H, draft_temperature=0.8, seed=seed) | cfg
        sides.append(SpeculativeLoop(store, config(**settings), [EOS]))
    return target, tuple(sides)


@pytest.mark.parametrize("t_t", [1.0, 0.6])
def test_sequential_schedule_reproduces_the_target(t_t):
    target, sides = mock_sides(target_temperature=t_t)
    run = minedraft_sampling(sides, [PROMPT] * 3000, threads=False)
    assert sum(run.accepted) < sum(run.drafted) and run.steps > 0
    exact, z = exact_target(target, PROMPT, H, temperature=t_t)
    assert chi_square_pvalue(Counter(map(tuple, run.token_ids)), {k: v / z for k, v in exact.items()}) > 1e-3


def test_threads_do_not_change_the_tokens():
    prompts = [PROMPT, [0, 1, 2], [2], [1, 1], [3, 0, 1]]  # odd: sides of 3 and 2
    outs = [minedraft_sampling(mock_sides()[1], prompts, threads=t).token_ids for t in (False, True)]
    assert outs[0] == outs[1]
    assert all(1 <= len(o) <= H for o in outs[0])
    assert all(EOS not in o[:-1] for o in outs[0])


def test_split_balanced():
    a, b = split_balanced([[0] * n for n in (9, 1, 1, 1, 8, 2)])
    assert sorted(a + b) == list(range(6)) and abs(len(a) - len(b)) <= 1
    assert split_balanced([[1]]) == ([0], [])


def test_shared_backends_are_refused():
    target, draft = mock_pair()
    a = SpeculativeLoop(RowStore(target, draft), config(), [EOS])
    b = SpeculativeLoop(RowStore(target, MockLM(4)), config(), [EOS])
    with pytest.raises(ValueError, match="separate backends"):
        minedraft_sampling((a, b), [PROMPT])


@pytest.mark.parametrize("n_prompts", [1, 4])
def test_runs_on_tiny_llamas(n_prompts):
    pair = SMCSD(*tiny.pair(eos_bias=8.0))
    prompts = ["the quick brown fox", "once upon a time", "rain falls", "what is the capital"][:n_prompts]
    cfg = SMCConfig(max_new_tokens=16, block_size=3)
    outs = pair.generate(prompts, method="minedraft", config=cfg)
    eos = set(pair.eos_token_ids)
    for o in outs:
        assert 1 <= len(o.token_ids) <= 16
        assert o.token_ids[-1] in eos or len(o.token_ids) == 16
        assert not eos & set(o.token_ids[:-1])
    stats = outs[0].stats
    assert stats.target_calls >= 1 + (n_prompts > 1) and stats.draft_calls > 0
    # Both schedules through the API give the same tokens (separate backends, own seeds).
    ids = [pair.encode(p) for p in prompts]

    def sides():
        return side_loops(pair.target_lm, pair.draft_lm, pair.eos_token_ids, cfg)

    a = minedraft_sampling(sides(), ids, threads=True, num_threads=1).token_ids
    b = minedraft_sampling(sides(), ids, threads=False).token_ids
    assert a == b == [o.token_ids for o in outs]

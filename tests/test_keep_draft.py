"""A server's engine keeps the draft's rows: a request that drafts joins a batch begun without it.

A batch whose requests all decode with the target alone leaves the draft out. Requests arriving
one by one would then queue behind a drafting one until the batch ends; a server's engine
(``keep_draft``) prefills the draft with every batch, so the drafting request joins at once and
returns what it returns alone.
"""

from __future__ import annotations

from helpers import EOS, config, mock_pair

from smcsd_ppl.engine.client import ServeRequest, program_of
from smcsd_ppl.engine.core import EngineCore
from smcsd_ppl.engine.pair import PairCore
from smcsd_ppl.engine.request import Request
from smcsd_ppl.inference.rows import RowStore


def pair() -> PairCore:
    target, draft = mock_pair(rare_eos=True)
    return PairCore.over(RowStore(target, draft), [EOS], decode=lambda ids: "".join("abcd"[t] for t in ids))


def request(core: EngineCore, prompt, seed: int, **kw) -> Request:
    settings = config(**{"seed": seed, "n_particles": 4, "block_size": 3, "max_new_tokens": 8} | kw)
    return Request(program_of(core.pair, ServeRequest(prompt, settings)), settings, seed)


def run(core: EngineCore) -> dict:
    """Step until nothing waits or runs; each finished request's token ids."""
    out = {}
    while core.has_work:
        out |= {o.id: o.result.token_ids for o in core.step() if o.finished}
    return out


def test_a_drafting_request_joins_a_batch_begun_by_one_that_does_not_draft():
    for keep in (False, True):
        core = EngineCore(pair(), config(seed=0), keep_draft=keep)
        first = request(core, [0, 1], 1, token_level=True, max_new_tokens=30)  # the target alone
        core.add(first)
        core.step()
        later = request(core, [2], 2)
        assert later.drafts and not first.drafts
        core.add(later)
        core.step()
        assert [r.id for r in core.running] == ([first.id, later.id] if keep else [first.id])
        joined = run(core)[later.id]
        alone = EngineCore(pair(), config(seed=0))
        again = request(alone, [2], 2)
        alone.add(again)
        assert run(alone)[again.id] == joined  # its own stream: the same tokens, joined or alone

"""``--deterministic``: a seeded request's forwards have the shapes they have alone (``backends.fixed``).

The tiny models here have a context of 4,096 positions, past the fixed width of 1,024 that
attention reads, and their batch-mates' prompts are of other lengths: without fixed shapes the
rows, positions and columns a request's forwards run at would follow them.
"""

from __future__ import annotations

import dataclasses

import pytest
import tiny
import torch

from smcsd_ppl.api import SMCSD
from smcsd_ppl.backends import hf
from smcsd_ppl.backends.fixed import Buckets, FixedShape, ShapedLM, bucket
from smcsd_ppl.backends.hf import HFBatchedLM
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.inference.program import SMCSDModel

CONFIG = SMCConfig(
    n_particles=4, block_size=3, max_new_tokens=24, draft_temperature=1.0, target_temperature=1.0, seed=3
)
PROMPTS = [list(range(5, 5 + n)) for n in (7, 3, 12, 5, 9, 2, 15, 4)]


@pytest.fixture(scope="module")
def long_context(monkeypatch_module):
    monkeypatch_module.setattr(tiny, "MAX_POSITIONS", 4096)
    return tiny.pair()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture
def shapes(monkeypatch):
    """Each forward's (rows, positions, columns), and whether the first request's rows were fed."""
    seen, real = [], hf.plan

    def plan(lengths, valid, width):
        seen.append((tuple(valid.shape), width, bool(valid[: CONFIG.n_particles].any())))
        return real(lengths, valid, width)

    monkeypatch.setattr(hf, "plan", plan)
    return seen


@pytest.mark.parametrize("cut", [None, 0.3])
def test_a_seeded_request_gives_the_same_output_alone_and_among_seven(long_context, cut):
    pair = SMCSD(*long_context, deterministic=True)
    assert isinstance(pair.target_lm, ShapedLM) and pair.target.model.config.max_position_embeddings == 4096
    cfg = dataclasses.replace(CONFIG, cut=cut)
    alone = pair.engine.run([SMCSDModel(PROMPTS[0])], cfg)[0].wait()
    together = [t.wait() for t in pair.engine.run([SMCSDModel(p) for p in PROMPTS], cfg)]
    assert together[0].token_ids == alone.token_ids
    assert together[0].smc.log_z == alone.smc.log_z  # bitwise: every product had the same shape


def test_its_forwards_run_at_fixed_rows_and_columns_alone_and_among_seven(long_context, shapes):
    pair = SMCSD(*long_context, deterministic=True)
    pair.engine.run([SMCSDModel(PROMPTS[0])], CONFIG)[0].wait()
    alone = {s[:2] for s in shapes if s[2]}
    [t.wait() for t in pair.engine.run([SMCSDModel(p) for p in PROMPTS], CONFIG)]
    assert {(rows, width) for (rows, _), width, _ in shapes} == {(64, 1024)}
    # positions: its prompt's length (its prefill, alone), else a power of two (its own counts)
    assert all(t == len(PROMPTS[0]) or t == bucket(t) for (_, t), _ in alone)


def test_without_fixed_shapes_its_rows_run_at_the_shapes_of_its_batch(long_context, shapes):
    """The negative: rows, positions and columns all follow the batch-mates."""
    pair = SMCSD(*long_context)
    pair.engine.run([SMCSDModel(PROMPTS[0])], CONFIG)[0].wait()
    alone = {s[:2] for s in shapes if s[2]}
    shapes.clear()
    [t.wait() for t in pair.engine.run([SMCSDModel(p) for p in PROMPTS], CONFIG)]
    together = {s[:2] for s in shapes if s[2]}
    assert not alone & together  # no forward of it alone had a shape it has among them
    assert max(r for (r, _), _ in together) > max(r for (r, _), _ in alone)
    assert max(w for _, w in together) > max(w for _, w in alone)


def test_a_row_computes_the_same_bits_whoever_its_batch_mates_are(long_context):
    """The backend itself: one row alone, then among rows of other lengths fed other counts."""
    model = long_context[0].model
    prompt, others = PROMPTS[0], PROMPTS[1:5]
    block = torch.tensor([[11, 12, 13]])
    fixed = FixedShape(rows=8, width=64)

    def row_logits(make, mates):
        lm = make()
        lm.prefill([prompt, *mates])
        valid = torch.ones(1 + len(mates), 3, dtype=torch.bool)
        valid[1:, :1] = False  # the batch-mates are fed two tokens, the row three
        return lm.extend(torch.cat([block] * (1 + len(mates))), valid)[0]

    fixed_alone = row_logits(lambda: ShapedLM(model, fixed), [])
    fixed_among = row_logits(lambda: ShapedLM(model, fixed), others)
    assert torch.equal(fixed_alone, fixed_among)
    usual_alone = row_logits(lambda: HFBatchedLM(model), [])
    torch.testing.assert_close(usual_alone, fixed_alone, rtol=1e-4, atol=1e-4)  # the same function


def test_buckets_are_powers_of_two_and_shapes_are_checked():
    assert [bucket(c) for c in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 16]
    with pytest.raises(ValueError, match="fixed shape"):
        FixedShape(rows=0)
    assert [Buckets().rows_for(n) for n in (1, 3, 8, 9)] == [1, 4, 8, 16]
    assert [Buckets().width_for(n) for n in (1, 256, 257)] == [256, 256, 512]


def test_what_it_cannot_honour_is_refused_in_one_line(long_context):
    pair = SMCSD(*long_context, deterministic=True)
    with pytest.raises(ValueError, match="1024"):
        pair.generate("hi", config=dataclasses.replace(CONFIG, max_new_tokens=2000))
    assert pair.engine.max_rows == 64  # a batch holds no more rows than every forward runs

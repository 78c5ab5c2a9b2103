"""The static path (``--engine compiled``) against the eager one it must reproduce.

The static path runs AR and the paper's SMC-SD with static shapes over KV arenas, each step
or cycle one graph with no host read inside. Uncompiled (graph mode ``eager``), it must give
the eager backends' tokens, weights and ESS for the same seeds: the exactness tests of the
eager kernel then hold for it. Compiled (``torch.compile(fullgraph=True)``), it must be one
graph (a graph break fails) and still give the same tokens in float32.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from smcsd_ppl import smc
from smcsd_ppl.api import SMCSD
from smcsd_ppl.backends.static import Arena, StaticLlama
from smcsd_ppl.backends.syncs import HostReads
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.inference import static_cycle
from smcsd_ppl.inference.static_ar import static_autoregressive
from smcsd_ppl.inference.static_engine import StaticEngine, graph_mode
from smcsd_ppl.inference.static_smcsd import static_smcsd
from smcsd_ppl.inference.step import request_seed
from smcsd_ppl.methods.ar import autoregressive

PAPER = SMCConfig(n_particles=4, block_size=3, max_new_tokens=20, cut=None, proposal="draft", seed=0)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]


def static_run(engine: StaticEngine, pair: SMCSD, prompts, config: SMCConfig):
    seeds = [request_seed(config.seed, i) for i in range(len(prompts))]
    return static_smcsd(engine, prompts, config, pair.core.eos_for(config), seeds)


def assert_same(eager, static):
    """Tokens equal; weights, ESS traces and resampling counts as the eager kernel's."""
    for e, s in zip(eager, static):
        assert s.token_ids == e.token_ids
        assert [p.token_ids for p in s.info.particles] == [p.token_ids for p in e.smc.particles]
        assert [p.log_weight for p in s.info.particles] == pytest.approx(
            [p.log_weight for p in e.smc.particles], rel=1e-4, abs=1e-4
        )
        assert s.info.ess_trace == pytest.approx(e.smc.ess_trace, rel=1e-4)
        assert s.info.n_resamples == e.smc.n_resamples


def test_the_static_forward_gives_the_models_logits(tiny_llama):
    model = StaticLlama(tiny_llama)
    arena = model.arena(2, 256)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    valid = torch.tensor([[True] * 6, [False, False] + [True] * 4])
    with torch.inference_mode():
        logits = model.forward(arena, ids, valid)
        assert arena.lengths.tolist() == [6, 4]
        torch.testing.assert_close(logits[0], tiny_llama(ids[:1]).logits[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[1, 2:], tiny_llama(ids[1:, 2:]).logits[0], rtol=1e-4, atol=1e-4)
        nxt = torch.tensor([[3, 4], [0, 4]])  # row 1 feeds a hole, then a token
        more = model.forward(arena, nxt, torch.tensor([[True, True], [False, True]]))
        assert arena.lengths.tolist() == [8, 5]
        whole = tiny_llama(torch.tensor([[11, 12, 13, 14, 4]])).logits[0, -1]
        torch.testing.assert_close(more[1, -1], whole, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="the order is for MKL builds")
def test_a_step_of_a_few_rows_takes_the_weight_on_the_left(tiny_llama, mm_calls):
    """A one-row step puts every weight on the left (``products.linear``): 7 per layer and the head."""
    model = StaticLlama(tiny_llama)
    arena = model.arena(1, 256)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])  # 11 rows: the usual order
    with torch.inference_mode():
        model.forward(arena, ids, torch.ones_like(ids, dtype=torch.bool))
        assert mm_calls == []
        step = model.forward(arena, torch.tensor([[4]]), torch.tensor([[True]]))
    assert len(mm_calls) == 7 * len(model.layers) + 1
    whole = tiny_llama(torch.cat([ids, torch.tensor([[4]])], 1)).logits[0, -1]
    torch.testing.assert_close(step[0, -1], whole, rtol=1e-4, atol=1e-4)


def test_the_static_forward_in_bf16_on_a_cpu_gives_the_models_logits(tiny_llama):
    """In bf16 on a CPU attention is three products (``static._attend``), not torch's fused kernel."""
    model = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    static = StaticLlama(model)
    arena = static.arena(2, 128)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
    with torch.inference_mode():
        static.forward(arena, ids, torch.tensor([[True] * 6, [False, False] + [True] * 4]))
        step = static.forward(arena, torch.tensor([[3], [4]]), torch.tensor([[True], [True]]))[:, -1]
        first = model(torch.tensor([[5, 6, 7, 8, 9, 10, 3]])).logits[0, -1].float()
        second = model(torch.tensor([[11, 12, 13, 14, 4]])).logits[0, -1].float()
    expected = torch.stack([first, second])
    torch.testing.assert_close(step, expected, rtol=0.02, atol=0.125)  # 2 bf16 ulps at 8-16


def test_an_arena_gather_copies_whole_rows(tiny_llama):
    model = StaticLlama(tiny_llama)
    arena = model.arena(3, 256)
    with torch.inference_mode():
        model.forward(
            arena, torch.tensor([[1, 2], [3, 4], [0, 5]]), torch.tensor([[1, 1], [1, 1], [0, 1]]).bool()
        )
        before = [k.clone() for k in arena.keys]
        arena.gather_(torch.tensor([2, 2, 0]))
    assert arena.lengths.tolist() == [1, 1, 2]
    for k, old in zip(arena.keys, before):
        assert torch.equal(k[0], old[2]) and torch.equal(k[2], old[0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_ar_gives_the_eager_tokens(eos_smcsd, temperature):
    """Both prompts at once: rows end at different tokens (frequent EOS) and draw no more."""
    engine = StaticEngine(eos_smcsd.target.model, None, "eager")
    eos = eos_smcsd.core.eos_token_ids
    for seed in range(3):
        runs = []
        for run, lm in ((autoregressive, eos_smcsd.target_lm), (static_autoregressive, engine)):
            g = torch.Generator().manual_seed(seed)
            runs.append(run(lm, PROMPTS, eos_token_ids=eos, max_new_tokens=24, temperature=temperature, g=g))
        assert runs[1] == runs[0]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"resampling": "stratified", "block_size": 4, "n_particles": 3},
        {"resampling": "multinomial", "alpha": 2.0, "target_temperature": 1.5, "draft_temperature": 1.5},
        {"selection": "argmax", "ess_threshold": 1.0},
        {"ess_threshold": 0.0},
    ],
    ids=["systematic", "stratified", "multinomial-alpha2", "argmax-always", "never"],
)
def test_static_smcsd_gives_the_eager_kernels_outputs(tiny_smcsd, tiny_models, settings):
    engine = StaticEngine(tiny_models[0].model, tiny_models[1].model, "eager")
    for seed in range(3):
        config = dataclasses.replace(PAPER, seed=seed, **settings)
        eager = tiny_smcsd.generate_ids(PROMPTS, method="smcsd_paper", config=config)
        assert_same(eager, static_run(engine, tiny_smcsd, PROMPTS, config))


def test_static_smcsd_ends_at_eos_as_the_eager_kernel(eos_smcsd):
    """EOS drafted inside blocks and drawn as bonuses: particles finish at different cycles."""
    target, draft = eos_smcsd.target.model, eos_smcsd.draft.model
    engine = StaticEngine(target, draft, "eager")
    ended = 0
    for seed in range(4):
        config = dataclasses.replace(PAPER, seed=seed, max_new_tokens=30)
        eager = eos_smcsd.generate_ids(PROMPTS, method="smcsd_paper", config=config)
        ended += sum(g.finish_reason == "eos" for g in eager)
        assert_same(eager, static_run(engine, eos_smcsd, PROMPTS, config))
    assert ended >= 2, "too few outputs ended at EOS to judge"


def test_a_cycle_that_does_not_move_the_kv_rows_with_the_particles_fails(
    tiny_smcsd, tiny_models, monkeypatch
):
    """The mutant: resampling moves the particles' tokens and weights but leaves their KV rows."""
    engine = StaticEngine(tiny_models[0].model, tiny_models[1].model, "eager")
    config = dataclasses.replace(PAPER, ess_threshold=1.0, max_new_tokens=24)
    eager = tiny_smcsd.generate_ids(PROMPTS, method="smcsd_paper", config=config)
    assert_same(eager, static_run(engine, tiny_smcsd, PROMPTS, config))
    monkeypatch.setattr(Arena, "move_rows_", lambda arena, ancestors: None)
    mutant = static_run(
        StaticEngine(tiny_models[0].model, tiny_models[1].model, "eager"), tiny_smcsd, PROMPTS, config
    )
    assert [r.token_ids for r in mutant] != [g.token_ids for g in eager]


def test_a_cycle_reads_the_host_once(tiny_smcsd, tiny_models):
    """Besides the set-up (the leads, who is done, the final weights), one read per cycle: its report."""
    target, draft = tiny_models[0].model, tiny_models[1].model
    engine = StaticEngine(target, draft, "eager")
    with HostReads([target, draft]) as reads:
        (out,) = static_run(engine, tiny_smcsd, PROMPTS[:1], dataclasses.replace(PAPER, ignore_eos=True))
    cycles = len(out.info.ess_trace)
    assert cycles >= 5
    assert reads.count <= cycles + 3, reads.names


def test_resampling_decides_alike_at_the_threshold():
    """Four equal weights of eight put the ESS on the threshold: one ulp must not decide."""
    log_w = torch.tensor([[0.0] * 4 + [-800.0] * 4], dtype=torch.float64)
    ess = smc.ess(log_w[0])
    assert not smc.below_threshold(ess * (1 - 1e-12), 8, 0.5)
    points = torch.tensor([[(i + 0.3) / 8 for i in range(8)]], dtype=torch.float64)
    _, ess_static, did = static_cycle.resample_rows(log_w.clone(), points, 0.5)
    assert float(ess_static) == pytest.approx(ess) and not bool(did)


def test_engine_choice_is_refused_or_kept_where_it_cannot_run(tiny_models):
    assert graph_mode("auto", torch.device("cpu")) == "eager"
    assert graph_mode("compiled", torch.device("cpu")) == "compile"
    assert graph_mode("compiled", torch.device("cuda")) == "cuda-graph"
    with pytest.raises(ValueError, match="engine must be one of"):
        graph_mode("fast", torch.device("cpu"))
    compiled = SMCSD(*tiny_models, engine="compiled")
    with pytest.raises(ValueError, match="runs ar and smcsd_paper"):
        compiled.generate_ids([PROMPTS[0]], method="smcsd", config=PAPER)
    assert SMCSD(*tiny_models, engine="auto").core.static_engine("ar") is None  # CPU: eager


@pytest.mark.slow
def test_the_compiled_cycle_is_one_graph_with_the_eager_tokens(tiny_smcsd, tiny_models):
    """``torch.compile(fullgraph=True)``: a host read or a data-dependent shape in a cycle fails here."""
    compiled = SMCSD(*tiny_models, engine="compiled")
    for seed in range(2):
        config = dataclasses.replace(PAPER, seed=seed)
        eager = tiny_smcsd.generate_ids(PROMPTS, method="smcsd_paper", config=config)
        out = compiled.generate_ids(PROMPTS, method="smcsd_paper", config=config)
        assert [g.token_ids for g in out] == [g.token_ids for g in eager]
        ar = dataclasses.replace(config, target_temperature=1.0)
        assert [g.token_ids for g in compiled.generate_ids(PROMPTS, method="ar", config=ar)] == [
            g.token_ids for g in tiny_smcsd.generate_ids(PROMPTS, method="ar", config=ar)
        ]
    assert compiled.core.static_engine("ar").compile_seconds > 0


def test_an_arena_is_kept_across_calls(tiny_models):
    engine = StaticEngine(tiny_models[0].model, tiny_models[1].model, "eager")
    first = engine.arena("target", 4, 60)
    assert engine.arena("target", 4, 120) is first  # the same capacity bucket
    assert isinstance(first, Arena) and first.capacity == 128  # the tiny model's context


def _alone_and_among_eight(engine: StaticEngine, pair: SMCSD, config: SMCConfig):
    prompts = [[5 + i, 6, 7 + 2 * i, 8, 9][: 2 + i % 4] + [10 + i] * (i % 3) for i in range(8)]
    seeds = [request_seed(config.seed, i) for i in range(8)]
    eos = pair.core.eos_for(config)
    batch = static_smcsd(engine, prompts, config, eos, seeds)
    alone = [static_smcsd(engine, [p], config, eos, [s])[0] for p, s in zip(prompts, seeds)]
    return batch, alone


def test_a_fixed_row_bucket_gives_a_request_its_tokens_alone_and_among_batch_mates(eos_smcsd):
    """--deterministic: alone or with 7 batch-mates, a request's every forward has the same shape."""
    config = dataclasses.replace(PAPER, max_new_tokens=24)
    models = eos_smcsd.target.model, eos_smcsd.draft.model
    batch, alone = _alone_and_among_eight(StaticEngine(*models, "eager", row_bucket=32), eos_smcsd, config)
    for b, a in zip(batch, alone):
        assert a.token_ids == b.token_ids
        assert [p.log_weight for p in a.info.particles] == [p.log_weight for p in b.info.particles]  # bitwise

"""The row store, the SMC loop and the high-level API on tiny random models.

Random weights say nothing about quality: these tests check forward counts,
determinism, error messages, output invariants and program semantics.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import tiny
import torch
from helpers import EOS, run_rows, smc

import smcsd_ppl.inference.cycle as cycle_module
import smcsd_ppl.methods.sd as sd_module
from smcsd_ppl.api import SMCSD
from smcsd_ppl.backends.base import NonFiniteLogits
from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.inference.blocks import BlockRequest, RowConstraint
from smcsd_ppl.inference.drafting import draft_blocks, generator_draws
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.rows import RowStore
from smcsd_ppl.potentials import Constraint

PROMPTS = ["The cat sat on", "Once upon a time there was a little girl who", "A"]


def cfg(**kw):
    base = dict(
        n_particles=4,
        block_size=3,
        max_new_tokens=10,
        seed=0,
        draft_temperature=0.7,
        target_temperature=1.0,
        cut=None,
    )
    return SMCConfig(**(base | kw))


# --- forward counting ---


@pytest.fixture
def block_lengths(monkeypatch):
    """Lengths of the blocks of every ``draft_blocks`` call, with the budgets asked."""
    calls = []

    def spy(store, requests, **kw):
        blocks = draft_blocks(store, requests, **kw)
        calls.append((blocks, [r.budget for r in requests]))
        return blocks

    monkeypatch.setattr(cycle_module, "draft_blocks", spy)
    monkeypatch.setattr(sd_module, "draft_blocks", spy)
    return calls


def test_one_target_and_up_to_k_draft_forwards_per_cycle(tiny_smcsd):
    cycles, lms = [], (tiny_smcsd.target_lm, tiny_smcsd.draft_lm)
    before = [lm.stats.calls for lm in lms]  # the backends count every forward, never reset
    out = tiny_smcsd.run([SMCSDModel(p) for p in PROMPTS], cfg(ignore_eos=True), on_cycle=cycles.append)
    n = len(cycles)
    assert n == 3  # x0, then 4 tokens per cycle (K=3 + bonus): 1 -> 5 -> 9 -> 10 (budget cut)
    stats = out[0].stats
    assert stats.target_calls == 1 + n
    drafts = 1 + 3 + 3 + 1  # prefill, two full blocks, then a budget of one token: one forward
    assert stats.draft_calls == drafts
    assert [lm.stats.calls - b for lm, b in zip(lms, before)] == [1 + n, drafts]
    for g in out:
        assert len(g.token_ids) == 10
        assert all(len(p.token_ids) == 10 for p in g.smc.particles)
    assert [c.cycle for c in cycles] == [1, 2, 3]
    assert cycles[-1].live == 0 and cycles[0].live == 12


def test_forward_counts_of_the_baselines(tiny_smcsd, block_lengths):
    steps = []
    sd = tiny_smcsd.generate(PROMPTS, method="sd", config=cfg(ignore_eos=True), on_progress=steps.append)
    assert sd[0].stats.target_calls == 1 + len(steps) == 1 + len(block_lengths)
    assert sd[0].stats.draft_calls == 1 + sum(len(blocks[0].tokens) for blocks, _ in block_lengths)
    assert all(len(g.token_ids) == 10 for g in sd)
    ar = tiny_smcsd.generate(PROMPTS, method="ar", config=cfg(ignore_eos=True))
    assert ar[0].stats.target_calls == 10 and ar[0].stats.draft_calls == 0
    assert all(len(g.token_ids) == 10 for g in ar)


def test_forward_counts_with_the_mock_backend():
    target, draft = MockLM(5, seed=0), MockLM(5, seed=1)
    cycles = []
    config = SMCConfig(n_particles=4, block_size=3, max_new_tokens=10, seed=0, cut=None)
    programs = [SMCSDModel([1, 2]), SMCSDModel([3]), SMCSDModel([0, 4, 1])]
    res = run_rows(programs, RowStore(target, draft), config, [], observer=cycles.append)  # no EOS
    assert len(cycles) == 3
    assert target.stats.calls == 1 + len(cycles)
    assert draft.stats.calls == 1 + 3 + 3 + 1  # the last block has a budget of one token
    assert all(len(p.token_ids) == 10 for r in res for p in r.smc.particles)


# --- seeded determinism ---


@pytest.mark.parametrize("method", ["smcsd", "sd", "ar"])
def test_same_seed_same_output_different_seed_different(tiny_models, tiny_smcsd, method):
    def run(seed, pair=tiny_smcsd):
        out = pair.generate(PROMPTS, method=method, config=cfg(seed=seed, max_new_tokens=12))
        return [(g.token_ids, g.smc) for g in out]

    first = run(3)
    assert run(3) == first
    assert run(3, SMCSD(*tiny_models)) == first  # no state leaks from one call into the next
    assert run(4) != first


def test_mock_smcsd_is_deterministic():
    def run(seed):
        programs = [SMCSDModel([1, 2]) for _ in range(5)]
        out = smc(
            MockLM(4, seed=0),
            MockLM(4, seed=1),
            programs,
            n_particles=3,
            block_size=2,
            max_new_tokens=6,
            seed=seed,
        )
        return [(r.token_ids, r.smc.log_z) for r in out]

    assert run(0) == run(0)
    assert run(0) != run(1)


# --- bad inputs ---


@pytest.mark.parametrize(
    "kw, culprit",
    [
        (dict(n_particles=0), "n_particles"),
        (dict(n_particles=2.0), "n_particles"),
        (dict(block_size=0), "block_size"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(draft_temperature=0), "draft_temperature"),
        (dict(target_temperature=-1), "target_temperature"),
        (dict(target_temperature=float("nan")), "target_temperature"),
        (dict(alpha=0), "alpha"),
        (dict(resampling="bogus"), "resampling"),
        (dict(ess_threshold=1.5), "ess_threshold"),
        (dict(selection="best"), "selection"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_config_raises(kw, culprit):
    with pytest.raises(ValueError, match=culprit):
        SMCConfig(**kw)


@pytest.mark.parametrize("prompt", ["", "   \n\t"])
@pytest.mark.parametrize("method", ["smcsd", "sd", "ar"])
def test_empty_prompt_raises(tiny_smcsd, prompt, method):
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_smcsd.generate(prompt, method=method, config=cfg())
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_smcsd.generate(["fine", prompt], method=method, config=cfg())


def text_of(smc, n_tokens):
    """A text prompt of exactly ``n_tokens`` tokens."""
    ids = smc.encode(" ".join(["the moon and the river"] * 40))[:n_tokens]
    text = smc.decode(ids)
    assert smc.encode(text) == ids
    return text


@pytest.mark.parametrize("method", ["smcsd", "sd", "ar"])
def test_prompt_longer_than_the_context_raises(tiny_smcsd, method):
    long = " ".join(["the moon and the river"] * 60)
    assert len(tiny_smcsd.encode(long)) > tiny.MAX_POSITIONS
    with pytest.raises(ValueError, match=r"context (is|of) 128"):
        tiny_smcsd.generate(["A", long], method=method, config=cfg())


@pytest.mark.parametrize("method", ["smcsd", "sd", "ar"])
def test_generation_that_cannot_fit_the_context_is_refused_up_front(tiny_models, method):
    smc = SMCSD(*tiny_models)
    with pytest.raises(ValueError, match=r"max_new_tokens \(60\).*context of 128") as err:
        smc.generate(["A", text_of(smc, 90)], method=method, config=cfg(max_new_tokens=60))
    assert "90 tokens" in str(err.value)
    assert smc.target_lm.stats.calls == 0 and smc.draft_lm.stats.calls == 0  # nothing ran


def test_program_running_past_the_context_raises_mid_run(tiny_smcsd):
    # SMCSD.run has no up-front check (a program may stop early): the backend refuses the forward.
    config = cfg(max_new_tokens=60, ignore_eos=True)
    with pytest.raises(ValueError, match="context is 128"):
        tiny_smcsd.run([SMCSDModel(text_of(tiny_smcsd, 90))], config)


def test_ar_accepts_any_request_that_fits_the_context(tiny_smcsd):
    prompt = text_of(tiny_smcsd, 100)
    out = tiny_smcsd.generate(prompt, method="ar", config=cfg(max_new_tokens=28, ignore_eos=True))
    assert len(out.token_ids) == 28  # 100 + 28 = 128 positions, the whole context


@pytest.mark.parametrize("method", ["smcsd", "sd", "ar"])
def test_kv_budget_is_checked_up_front(tiny_models, method):
    target, draft = tiny_models
    smc = SMCSD(target, draft, max_cache_bytes=2**16)
    smc.generate("The cat", method=method, config=cfg(n_particles=2))  # fits
    calls = smc.target_lm.stats.calls
    rows = 3 * 256 if method == "smcsd" else 3
    with pytest.raises(ValueError, match="max_cache_bytes") as err:
        smc.generate(PROMPTS, method=method, config=cfg(n_particles=256, max_new_tokens=80))
    assert f"{rows} rows" in str(err.value)
    assert smc.target_lm.stats.calls == calls  # refused before any forward


@pytest.mark.parametrize("method", ["smcsd", "sd", "ar"])
def test_an_idle_pair_holds_no_rows_and_answers_as_before(tiny_models, method):
    pair = SMCSD(*tiny_models)
    first = pair.generate(PROMPTS, method=method, config=cfg())
    for lm in (pair.target_lm, pair.draft_lm):
        assert lm.n_rows == 0 and lm.cache_bytes == 0, lm.name
    again = pair.generate(PROMPTS, method=method, config=cfg())
    assert [g.token_ids for g in again] == [g.token_ids for g in first]


def test_different_tokenizers_raise(tiny_models):
    target, _ = tiny_models
    other = tiny.mismatched_draft()
    with pytest.raises(ValueError, match="different tokenizers") as err:
        SMCSD(target, other)
    assert "tiny-other" in str(err.value) and "tiny-target" in str(err.value)


def test_different_vocab_sizes_raise_in_the_row_store():
    with pytest.raises(ValueError, match="vocabulary"):
        RowStore(MockLM(5), MockLM(4))


def test_non_text_prompt_is_named_as_such(tiny_smcsd):
    with pytest.raises(ValueError) as err:
        tiny_smcsd.generate([[289, 282, 265]])
    assert "empty" not in str(err.value) and "str" in str(err.value)


def test_chat_template_is_applied_when_present(tiny_models):
    target, draft = tiny_models
    tok = copy.deepcopy(target.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    chat = SMCSD(dataclasses.replace(target, tokenizer=tok), dataclasses.replace(draft, tokenizer=tok))
    ids = chat.encode("The cat")
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "<|endoftext|>user: The cat\nassistant:"
    plain = SMCSD(dataclasses.replace(target, tokenizer=tok), draft, chat=False)  # same vocabulary
    assert plain.encode("The cat") == target.tokenizer("The cat")["input_ids"]
    assert chat.generate("The cat", config=cfg()).token_ids


def test_unknown_method_raises(tiny_smcsd):
    with pytest.raises(ValueError, match="bogus"):
        tiny_smcsd.generate("The cat", method="bogus")


def test_generate_ids_is_generate_on_encoded_prompts(tiny_smcsd):
    config = cfg(max_new_tokens=6, seed=3)
    text = tiny_smcsd.generate("The cat", method="sd", config=config)
    (ids,) = tiny_smcsd.generate_ids([tiny_smcsd.encode("The cat")], method="sd", config=config)
    assert ids.token_ids == text.token_ids and ids.text == text.text and ids.method == "sd"
    with pytest.raises(ValueError, match="no prompts"):
        tiny_smcsd.generate_ids([], method="sd")
    with pytest.raises(ValueError, match="bogus"):
        tiny_smcsd.generate_ids([[1, 2]], method="bogus")


def test_exact_sd_needs_alpha_one(tiny_smcsd):
    with pytest.raises(ValueError, match="alpha must be 1"):
        tiny_smcsd.generate("The cat", method="sd", config=cfg(alpha=2.0))


def test_text_prompt_without_tokenizer_raises():
    with pytest.raises(ValueError, match="tokenizer"):
        smc(MockLM(5), MockLM(5, seed=1), [SMCSDModel("text")], max_new_tokens=4)


def nan_after_prefill(model):
    """Make the model's logits NaN from its second forward on (prefill stays clean).

    On the input embeddings: every forward calls them, ours and the model's own alike.
    """
    calls = []

    def hook(module, args, output):
        calls.append(1)
        return output * float("nan") if len(calls) > 1 else output

    return model.get_input_embeddings().register_forward_hook(hook)


@pytest.mark.parametrize("forward", ["auto", "reference"])
@pytest.mark.parametrize("which", ["target", "draft"])
@pytest.mark.parametrize("method", ["smcsd", "sd"])
def test_nan_logits_during_generation_raise(which, method, forward):
    target, draft = tiny.pair()  # fresh models: the hook must not leak into other tests
    pair = SMCSD(target, draft, forward=forward)
    handle = nan_after_prefill((target if which == "target" else draft).model)
    with pytest.raises(NonFiniteLogits, match="NaN") as err:
        pair.generate(PROMPTS, method=method, config=cfg())
    assert which in str(err.value)
    handle.remove()


def test_nan_logits_mid_run_with_the_mock_backend():
    table = MockLM(4, seed=0).table.clone()
    table[2, 1] = float("nan")  # the context (..., 2, 1) breaks the target
    target = MockLM(table=table)
    programs = [SMCSDModel([2, 0]) for _ in range(8)]
    with pytest.raises(NonFiniteLogits, match="NaN"):
        smc(target, MockLM(4, seed=1), programs, n_particles=4, block_size=2, max_new_tokens=20, seed=0)


# --- no printing ---


@pytest.mark.parametrize("method", ["smcsd", "sd", "ar"])
def test_the_library_never_prints(tiny_smcsd, capsys, method):
    tiny_smcsd.generate(PROMPTS, method=method, config=cfg())
    tiny_smcsd.run([SMCSDModel("The cat")], cfg())
    assert capsys.readouterr().out == ""


# --- output invariants ---


def assert_well_formed(pair, gen, max_new_tokens, eos):
    assert gen.text == pair.decode(gen.token_ids)
    particles = gen.smc.particles if gen.smc else []
    seqs = [gen.token_ids] + [p.token_ids for p in particles]
    for seq in seqs:
        assert 1 <= len(seq) <= max_new_tokens, seq
        assert not any(t in eos for t in seq[:-1]), f"EOS before the end: {seq}"
        assert seq[-1] in eos or len(seq) == max_new_tokens, f"stopped early without EOS: {seq}"
    for p in particles:
        assert p.text == pair.decode(p.token_ids)


@pytest.mark.parametrize("method", ["sd", "ar"])
def test_baseline_outputs_stop_at_eos_and_budget(eos_smcsd, method):
    eos = set(eos_smcsd.eos_token_ids)
    outs = eos_smcsd.generate(PROMPTS * 4, method=method, config=cfg(max_new_tokens=12, seed=1))
    for g in outs:
        assert_well_formed(eos_smcsd, g, 12, eos)
    assert any(g.token_ids[-1] in eos for g in outs) and any(len(g.token_ids) == 12 for g in outs)


def test_smcsd_outputs_within_budget_and_end_at_eos_when_drafted(eos_smcsd):
    # Drafted EOS, bonus EOS and budget cuts all end particles.
    eos = set(eos_smcsd.eos_token_ids)
    outs = eos_smcsd.generate(PROMPTS, config=cfg(max_new_tokens=12, n_particles=6, seed=1))
    assert len(outs) == len(PROMPTS)
    for g in outs:
        assert g.text == eos_smcsd.decode(g.token_ids)
        assert len(g.smc.particles) == 6
        for p in g.smc.particles:
            assert 1 <= len(p.token_ids) <= 12
            assert p.text == eos_smcsd.decode(p.token_ids)
            assert p.token_ids[-1] in eos or len(p.token_ids) == 12
        assert g.token_ids in [p.token_ids for p in g.smc.particles]
        assert math.isfinite(g.smc.log_z)


def test_smcsd_particles_end_at_their_first_eos():
    # The draft rarely proposes EOS, the target often draws it: EOS comes as a bonus token.
    pair = SMCSD(*tiny.pair(eos_bias=8.0, draft_eos_bias=0.0))
    eos = set(pair.eos_token_ids)
    ended = []
    for seed in range(4):  # no resampling: particles stay distinct
        config = cfg(max_new_tokens=12, n_particles=6, ess_threshold=0.0, seed=seed)
        for g in pair.generate(PROMPTS * 2, config=config):
            assert_well_formed(pair, g, 12, eos)
            ended += [p.token_ids[-1] in eos for p in g.smc.particles]
    assert sum(ended) >= 10  # EOS did come (seeded: 18 of 144 particles)


def test_mock_smcsd_particles_end_at_their_first_eos():
    programs = [SMCSDModel([1, 2]) for _ in range(50)]
    res = smc(
        MockLM(4, seed=0), MockLM(4, seed=3), programs, block_size=2, max_new_tokens=8, n_particles=4, seed=1
    )
    particles = [p.token_ids for r in res for p in r.smc.particles]
    assert [p for p in particles if EOS in p[:-1]] == []
    assert sum(p[-1] == EOS for p in particles) > len(particles) // 4  # EOS did come, often


# --- SMCSDModel programs ---


class Reject(SMCSDModel):
    """Every particle fails its condition after its first block."""

    async def step(self):
        await self.extend()
        self.condition(False)


class RejectAtOnce(SMCSDModel):
    """Every particle fails before drafting anything."""

    async def step(self):
        self.condition(False)


@pytest.mark.parametrize("program", [Reject, RejectAtOnce])
def test_all_particles_rejected_gives_an_empty_result_with_a_message(tiny_smcsd, program):
    cycles = []
    out = tiny_smcsd.run([program("The cat"), SMCSDModel("A")], cfg(), on_cycle=cycles.append)
    dead, alive = out
    assert dead.text == "" and dead.token_ids == []
    assert "zero weight" in dead.message
    assert dead.smc.log_z == -math.inf
    assert all(p.log_weight == -math.inf for p in dead.smc.particles)
    assert alive.message == "" and alive.text == tiny_smcsd.decode(alive.token_ids) and alive.token_ids
    assert len(cycles) <= 4


def test_forward_counts_do_not_depend_on_finished_particles(eos_smcsd, block_lengths):
    cycles = []
    out = eos_smcsd.run(
        [SMCSDModel(p) for p in PROMPTS], cfg(max_new_tokens=16, n_particles=6), on_cycle=cycles.append
    )
    assert any(len(p.token_ids) < 16 for g in out for p in g.smc.particles)  # some stopped early at EOS
    assert out[0].stats.target_calls == 1 + len(cycles) == 1 + len(block_lengths)
    assert out[0].stats.draft_calls == 1 + sum(len(blocks[0].tokens) for blocks, _ in block_lengths)
    assert [c.live for c in cycles] == sorted((c.live for c in cycles), reverse=True)


class Twisted(SMCSDModel):
    """Plain generation plus a heuristic twist after every unfinished block."""

    def __init__(self, prompt, amount):
        super().__init__(prompt)
        self.amount = amount

    async def step(self):
        await self.extend()
        if not self.finished:
            self.twist(self.amount(self))


TWISTS = {
    "constant": lambda p: 1.5,
    "token-dependent": lambda p: -0.25 * (p.token_ids[-1] % 7),
}


@pytest.mark.parametrize("twist", TWISTS)
def test_twists_leave_final_weights_unchanged(tiny_smcsd, twist):
    # Without resampling a twist cannot change the random path: the final log-weights
    # are the untwisted ones (twists are removed before each step and at finish).
    config = cfg(ess_threshold=0.0, ignore_eos=True, max_new_tokens=14, seed=2)
    plain = tiny_smcsd.run([SMCSDModel(p) for p in PROMPTS], config)
    twisted = tiny_smcsd.run([Twisted(p, TWISTS[twist]) for p in PROMPTS], config)
    assert [g.token_ids for g in plain] == [g.token_ids for g in twisted]
    for a, b in zip(plain, twisted):
        a, b = a.smc, b.smc
        assert b.n_resamples == 0
        assert [p.token_ids for p in a.particles] == [p.token_ids for p in b.particles]
        assert [p.log_weight for p in b.particles] == pytest.approx(
            [p.log_weight for p in a.particles], abs=1e-9
        )
        assert b.log_z == pytest.approx(a.log_z, abs=1e-9)


def test_constant_twist_with_resampling_changes_nothing_normalized(tiny_smcsd):
    # A constant twist leaves the normalized weights, hence resampling, unchanged; the
    # twists are divided out again, so log Z and the normalized final weights must agree.
    config = cfg(ess_threshold=0.5, ignore_eos=True, max_new_tokens=14, seed=1)  # see below
    cycles = []
    plain = tiny_smcsd.run([SMCSDModel(p) for p in PROMPTS], config, on_cycle=cycles.append)
    twisted = tiny_smcsd.run([Twisted(p, TWISTS["constant"]) for p in PROMPTS], config)
    # non-trivial: every request resampled mid-run but not on the last cycle
    for i in range(len(PROMPTS)):
        assert any(c.resampled[i] for c in cycles[:-1]) and not cycles[-1].resampled[i]
    for a, b in zip(plain, twisted):
        a, b = a.smc, b.smc
        assert a.n_resamples == b.n_resamples > 0
        assert [p.token_ids for p in a.particles] == [p.token_ids for p in b.particles]
        assert b.log_z == pytest.approx(a.log_z, abs=1e-9)
        wa = torch.softmax(torch.tensor([p.log_weight for p in a.particles], dtype=torch.float64), 0)
        wb = torch.softmax(torch.tensor([p.log_weight for p in b.particles], dtype=torch.float64), 0)
        torch.testing.assert_close(wa, wb)


@pytest.mark.parametrize("method", ["smcsd", "sd"])
def test_drafting_stops_once_every_row_has_ended(eos_smcsd, block_lengths, method):
    """A block is shorter than K exactly when every row had ended by its last token, not sooner."""
    config = cfg(max_new_tokens=7, n_particles=6, block_size=4, seed=5)
    if method == "smcsd":
        eos_smcsd.run([SMCSDModel(p) for p in PROMPTS], config)
    else:
        eos_smcsd.generate(PROMPTS, method="sd", config=config)
    eos = set(eos_smcsd.eos_token_ids)

    def ended_by(block, budget, n):  # EOS among the first n tokens, or the budget spent
        return any(t in eos for t in block.tokens[:n]) or budget <= n

    shorter = 0
    for blocks, budgets in block_lengths:
        n = len(blocks[0].tokens)
        assert all(len(b.tokens) == n == len(b.draft_logq) for b in blocks)
        assert not all(ended_by(b, k, n - 1) for b, k in zip(blocks, budgets))
        if n < 4:
            shorter += 1
            assert all(ended_by(b, k, n) for b, k in zip(blocks, budgets))
    assert shorter  # the EOS-heavy pair and the budget make some blocks short


class FewTokens(Constraint):
    """Allows a fixed handful of tokens (different ones at even and odd positions), and EOS."""

    def __init__(self, eos):
        self.eos = eos

    def next_mask(self, contexts):
        out = torch.zeros(len(contexts), 300, dtype=torch.bool)
        for i, c in enumerate(contexts):
            out[i, [5, 9, 40, 41] if len(c) % 2 else [7, 8, 99]] = True
            out[i, self.eos] = True
        return out


@pytest.mark.parametrize("keep_probs", [False, True])
def test_drafting_over_the_allowed_tokens_only_changes_nothing(tiny_smcsd, monkeypatch, keep_probs):
    """Logits of the allowed tokens only (a few of V) give the same blocks as full logits, masked."""
    import smcsd_ppl.inference.constrained as constrained

    pair = tiny_smcsd
    few = FewTokens(pair.eos_token_ids[0])
    calls = []
    real_extend = pair.draft_lm.extend

    def spy(*args, **kwargs):
        calls.append("vocab" in kwargs)
        return real_extend(*args, **kwargs)

    monkeypatch.setattr(pair.draft_lm, "extend", spy)
    runs = {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(constrained, "shared_vocab", lambda masks, v: None)
        calls.clear()
        store = pair.rows()
        logits = store.start([pair.encode(p) for p in PROMPTS], [0, 0, 0, 1, 1, 1, 2, 2, 2])
        store.queue({r: [x] for r, x in enumerate(logits.argmax(-1).tolist())})
        requests = [BlockRequest(r, 10, RowConstraint(few, "proposal", ())) for r in range(store.n_rows)]
        draws = generator_draws(torch.Generator().manual_seed(4), store.n_rows, store.device)
        kw = dict(
            block_size=4, temperature=0.7, eos=set(pair.eos_token_ids), draws=draws, keep_probs=keep_probs
        )
        runs[shared] = draft_blocks(store, requests, **kw)
        assert any(calls) == shared
    for a, b in zip(runs[True], runs[False]):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.draft_logq, b.draft_logq, atol=1e-5, rtol=1e-5)
        if keep_probs:
            torch.testing.assert_close(a.draft_probs, b.draft_probs, atol=1e-6, rtol=1e-5)


def test_draft_on_another_device_raises():
    draft = MockLM(5, seed=1)
    draft.device = torch.device("meta")
    with pytest.raises(ValueError, match="different devices"):
        RowStore(MockLM(5), draft)


def test_nan_logits_during_autoregressive_sampling_raise():
    target, draft = tiny.pair()
    pair = SMCSD(target, draft)
    handle = nan_after_prefill(target.model)
    with pytest.raises(NonFiniteLogits, match="NaN") as err:
        pair.generate(PROMPTS, method="ar", config=cfg())
    assert "target" in str(err.value)
    handle.remove()


def test_the_paper_s_method_runs_the_draft_with_no_cut():
    """The settings the engine runs ``smcsd_paper`` with: the paper's (no cut, the draft)."""
    from smcsd_ppl import methods
    from smcsd_ppl.config import paper_settings

    asked = SMCConfig(proposal="retrieval", cut=0.5)
    assert (
        methods.get("smcsd_paper").settings(asked)
        == paper_settings(asked)
        == dataclasses.replace(asked, cut=None, proposal="draft")
    )

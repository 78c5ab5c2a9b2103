"""One request, every way in: the library, ``smcsd batch`` and the server give one answer.

Each is a request of the pair's engine (``Engine.run`` or ``Engine.submit``), so the same
prompt, settings and request seed end for the same reason with the same tokens (float32).
"""

from __future__ import annotations

import pytest
from test_serve_http import served

from smcsd_ppl.api import SMCSD
from smcsd_ppl.batch import Prompt, run_batch
from smcsd_ppl.config import SMCConfig
from smcsd_ppl.engine.client import Engine
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.step import SMCSDKernel
from smcsd_ppl.potentials.spec import ConstraintSpec

PROMPT = "The quick brown fox"
CONFIG = SMCConfig(
    n_particles=4, block_size=3, max_new_tokens=16, draft_temperature=1.0, target_temperature=1.0
)


def library(pair, seed: int, spec: ConstraintSpec | None):
    """``pair.generate`` (``pair.run`` of the constrained program), request 0 of a call seeded ``seed``."""
    config = SMCConfig(**{**CONFIG.__dict__, "seed": seed})
    if spec is None:
        out = pair.generate(PROMPT, config=config)
    else:
        constraint = spec.build(pair.tokenizer, pair.eos_token_ids)
        [out] = pair.run([SMCSDModel(pair.encode(PROMPT), constraint)], config)
    return out.text, out.token_ids, out.finish_reason


def server(pair, seed: int, spec: ConstraintSpec | None):
    """One completion from a live server of ``pair`` with the same settings and seed."""
    ask = {"prompt": PROMPT, "seed": seed, "max_tokens": CONFIG.max_new_tokens, "logprobs": 1}
    ask |= {"return_tokens_as_token_ids": True} | ({} if spec is None else {"regex": spec.text})
    with served(pair, defaults=CONFIG) as client:
        response = client.post("/v1/completions", json=ask)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    return choice["text"], ids, choice["smcsd"]["finish_reason"]


@pytest.mark.parametrize("regex", [None, "(yes|no|maybe)( (yes|no))?"])
def test_the_same_request_ends_the_same_on_every_path(tiny_smcsd, tmp_path, regex):
    spec = None if regex is None else ConstraintSpec("regex", regex)
    prompts = [Prompt("0", PROMPT, "story")]
    [record] = run_batch(tiny_smcsd, prompts, tmp_path / "b.jsonl", CONFIG, constraint=spec).records
    text, ids, reason = library(tiny_smcsd, record["seed"], spec)
    assert (record["text"], record["new_tokens"], record["finish_reason"]) == (text, len(ids), reason)
    assert server(tiny_smcsd, record["seed"], spec) == (text, ids, reason)
    assert ids and reason in (("constraint",) if regex else ("eos", "length")), reason


def test_smcsd_inside_a_call_takes_the_engines_turns_and_answers_as_outside(tiny_smcsd):
    """From the torch thread the caller steps the engine's one core itself: the same answer as a request."""
    outside = tiny_smcsd.generate([PROMPT, "Once upon"], config=CONFIG)
    inside = tiny_smcsd.call(lambda: tiny_smcsd.generate([PROMPT, "Once upon"], config=CONFIG))
    assert [(g.token_ids, g.smc.log_z) for g in inside] == [(g.token_ids, g.smc.log_z) for g in outside]
    assert not tiny_smcsd.engine.busy


def test_a_call_from_inside_a_cycle_is_refused_in_one_line(tiny_smcsd):
    def observe(_info):
        tiny_smcsd.generate("Hi", method="ar", config=CONFIG)  # AR runs as a call: it would move the rows

    with pytest.raises(RuntimeError, match="cannot run from inside a cycle"):
        tiny_smcsd.run([SMCSDModel(tiny_smcsd.encode(PROMPT))], CONFIG, on_cycle=observe)
    assert tiny_smcsd.generate(PROMPT, config=CONFIG).token_ids  # the engine goes on


def test_smcsd_from_inside_a_cycle_is_refused_in_one_line(tiny_smcsd):
    def observe(_info):
        tiny_smcsd.engine.run([SMCSDModel(tiny_smcsd.encode("Hi"))], CONFIG)

    with pytest.raises(RuntimeError, match="cannot run from inside a cycle"):
        tiny_smcsd.run([SMCSDModel(tiny_smcsd.encode(PROMPT))], CONFIG, on_cycle=observe)
    assert tiny_smcsd.generate(PROMPT, config=CONFIG).token_ids  # the engine goes on


@pytest.fixture
def steps_in_calls(monkeypatch):
    """For each SMC-SD step of the engine's kernel: whether it ran inside an ``Engine.call``."""
    inside, seen = [], []
    real_call, real_step = Engine.call, SMCSDKernel.step

    def call(self, fn):
        def marked():
            inside.append(True)
            try:
                return fn()
            finally:
                inside.pop()

        return real_call(self, marked)

    async def step(self, state):
        seen.append(bool(inside))
        return await real_step(self, state)

    monkeypatch.setattr(Engine, "call", call)
    monkeypatch.setattr(SMCSDKernel, "step", step)
    return seen


@pytest.mark.parametrize("method", ["smcsd", "smcsd_paper"])
def test_no_smcsd_method_runs_inside_a_call(tiny_smcsd, steps_in_calls, method):
    """Every SMC-SD method is a request of the engine's one core: none has a driver of its own."""
    tiny_smcsd.generate([PROMPT, "Once upon"], method=method, config=CONFIG)
    assert steps_in_calls and not any(steps_in_calls)


def test_the_mutant_that_runs_smcsd_as_a_call_fails_that_check(tiny_smcsd, steps_in_calls, monkeypatch):
    real = SMCSD._generate
    monkeypatch.setattr(SMCSD, "_generate", lambda self, *a: self.call(lambda: real(self, *a)))
    tiny_smcsd.generate(PROMPT, config=CONFIG)
    assert any(steps_in_calls)


class Plain(SMCSDModel):
    """The tutorial's first program: a step that only extends."""

    async def step(self):
        await self.extend()


class Conditioned(SMCSDModel):
    async def step(self):
        await self.extend()
        self.condition(True)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_program_whose_step_is_the_default_s_runs_as_generate(tiny_smcsd, seed):
    """Same tokens, same draft and target calls: it takes every decision the default takes."""
    config = SMCConfig(n_particles=4, block_size=4, draft_temperature=0.7, target_temperature=0.7, seed=seed)
    config = SMCConfig(**{**config.__dict__, "max_new_tokens": 24})
    ran = tiny_smcsd.run([Plain(PROMPT)], config)[0]
    made = tiny_smcsd.generate(PROMPT, config=config)
    assert ran.token_ids == made.token_ids and ran.smc.log_z == made.smc.log_z
    assert (ran.stats.target_calls, ran.stats.draft_calls) == (
        made.stats.target_calls,
        made.stats.draft_calls,
    )
    assert Plain(PROMPT).plain and not Conditioned(PROMPT).plain


@pytest.mark.parametrize("method", ["smcsd", "smcsd_paper"])
def test_a_request_alone_counts_every_draft_forward_and_names_its_proposals(tiny_smcsd, method):
    draft = tiny_smcsd.core.draft_lm
    config = SMCConfig(n_particles=4, block_size=4, max_new_tokens=24, seed=1)
    before = draft.stats.calls
    out = tiny_smcsd.generate(PROMPT, method=method, config=config)
    assert out.stats.draft_calls == draft.stats.calls - before > 0
    lengths, proposals = out.smc.draft_lengths, out.smc.proposals
    assert len(proposals) == len(lengths) and all(
        (n == 0) == (p == "target") for n, p in zip(lengths, proposals)
    )
    assert out.to_record()["draft_calls"] == out.stats.draft_calls
    assert out.stats.target_seconds > 0 and out.stats.draft_seconds > 0 and out.stats.overhead_fraction < 1

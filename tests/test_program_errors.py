"""Programs that go wrong say so in one line: no progress, a forgotten await, a text as constraint,
a constraint that kills every particle; and results say what they measure."""

from __future__ import annotations

import asyncio
import gc
import math
import warnings
from types import SimpleNamespace

import llamppl
import pytest
import torch

from smcsd_ppl import SMCConfig, SMCSDModel
from smcsd_ppl.cli.generate import _ess
from smcsd_ppl.potentials import RegexConstraint

CFG = SMCConfig(n_particles=4, block_size=3, max_new_tokens=8, seed=0, cut=None)


class Idle(SMCSDModel):
    """A step that never extends, samples, observes or finishes."""

    async def step(self):
        pass


class SometimesIdle(SMCSDModel):
    """Extends every other cycle only: slow, but it progresses."""

    def __init__(self, prompt):
        super().__init__(prompt)
        self.cycles = 0

    async def step(self):
        self.cycles += 1
        if self.cycles % 2 == 0:
            await self.extend()


def test_a_step_that_never_extends_raises_instead_of_hanging(tiny_smcsd):
    with pytest.raises(ValueError, match=r"Idle.step\(\) made no progress .* extend\(\)"):
        tiny_smcsd.run([Idle("The cat")], CFG)
    [out] = tiny_smcsd.run([SometimesIdle("The cat")], CFG)
    assert out.token_ids


class Forgot(SMCSDModel):
    async def step(self):
        self.observe(self.context.next_token(), 5)  # missing await: a no-op in LLaMPPL
        await self.extend()


def test_observe_without_await_is_an_error(tiny_smcsd):
    with pytest.raises(ValueError, match=r"Forgot.step\(\) called self.observe\(...\) without await"):
        tiny_smcsd.run([Forgot("The cat")], CFG)


def test_a_string_as_constraint_names_the_fix(tiny_smcsd):
    with pytest.raises(ValueError, match="must be a smcsd_ppl.potentials.Constraint.*RegexConstraint"):
        SMCSDModel("The cat", r"[a-z]+")


def test_critic_mode_death_blames_the_constraint_and_suggests_proposal_mode(tiny_smcsd):
    only = RegexConstraint("zzzz", tiny_smcsd.tokenizer, tiny_smcsd.eos_token_ids)
    [out] = tiny_smcsd.run([SMCSDModel("The cat", only, "critic")], CFG)
    assert out.text == "" and "critic" in out.message and "proposal" in out.message
    assert all(p.dead for p in out.smc.particles)  # their cut texts are no outputs


class Rejects(SMCSDModel):
    async def step(self):
        await self.extend()
        self.condition(False)


def test_a_condition_death_blames_the_conditions(tiny_smcsd):
    [out] = tiny_smcsd.run([Rejects("The cat")], CFG)
    assert "conditions" in out.message and all(p.dead for p in out.smc.particles)


def test_mean_ess_is_a_number_when_the_run_ends_at_its_first_token(tiny_smcsd):
    [out] = tiny_smcsd.run([SMCSDModel("The cat")], SMCConfig(n_particles=4, max_new_tokens=1, seed=0))
    assert len(out.token_ids) == 1 and out.smc.mean_ess == pytest.approx(4.0)


def test_the_stats_line_says_what_the_mean_ess_averages():
    alone = SimpleNamespace(particle_trace=[8, 1, 1, 1])
    assert _ess(alone, "5.00/8") == "mean ESS 5.00/8 over 1 cycle(s); 3 more with one particle"
    assert _ess(SimpleNamespace(particle_trace=[1, 1]), "1.00/8") == "one particle throughout (2 cycles)"


def test_llamppl_smc_standard_on_an_smcsd_program_names_the_way_to_run_it():
    with pytest.raises(ValueError, match="SMCSD.run or smcsd_ppl.llamppl.smc_standard"):
        asyncio.run(llamppl.smc_standard(SMCSDModel("The cat"), 2))


def test_dead_particles_are_marked(tiny_smcsd):
    outs = tiny_smcsd.run([Rejects("A"), SMCSDModel("A")], CFG)
    assert all(p.dead for p in outs[0].smc.particles)
    assert not any(p.dead for p in outs[1].smc.particles)
    assert all(math.isfinite(p.log_weight) == (not p.dead) for g in outs for p in g.smc.particles)
    assert torch.isfinite(torch.tensor(outs[1].smc.log_z))


class Conditioned(SMCSDModel):
    """A condition after each block, always ``holds``: a program whose N is part of the inference."""

    def __init__(self, prompt, holds: bool = True):
        super().__init__(prompt)
        self.holds = holds

    async def step(self):
        await self.extend()
        self.condition(self.holds)


def test_only_plain_generation_goes_on_alone(tiny_smcsd):
    """The default cut may send a plain request on with one particle; programs keep their N."""
    config = SMCConfig(n_particles=4, block_size=3, max_new_tokens=12, seed=0, ignore_eos=True)
    tokenizer, eos = tiny_smcsd.tokenizer, tiny_smcsd.eos_token_ids
    programs = [Conditioned("Hello"), SMCSDModel("Hello", RegexConstraint("[a-z ]+", tokenizer, eos))]
    for out in tiny_smcsd.run(programs, config):
        assert set(out.smc.particle_trace) == {4} and len(out.smc.particles) == 4 and not out.smc.alone
    [plain] = tiny_smcsd.run([SMCSDModel("Hello")], config)
    assert plain.smc.alone == (plain.smc.particle_trace[-1] == 1) == (len(plain.smc.particles) == 1)


def test_a_request_ends_for_the_same_reason_on_every_path(tiny_smcsd):
    """``pair.run`` (the method table) and the engine (server, batch) decide the reason in one place."""
    from smcsd_ppl.inference.step import request_seed

    config = SMCConfig(n_particles=4, block_size=3, max_new_tokens=24, seed=3, cut=None)
    tokenizer, eos = tiny_smcsd.tokenizer, tiny_smcsd.eos_token_ids

    def programs():
        return [
            SMCSDModel("Hello", RegexConstraint("(ab|cd)+ ", tokenizer, eos)),
            Conditioned("Hello", holds=False),
        ]  # every particle dies: error

    via_run = tiny_smcsd.call(lambda: tiny_smcsd.run(programs(), config))  # on the torch thread: the table
    seed = request_seed(config.seed, 0)
    via_engine = [
        tiny_smcsd.engine.submit_program(p, config, seed=seed).wait(timeout=120) for p in programs()
    ]
    assert [g.finish_reason for g in via_run] == [g.finish_reason for g in via_engine]
    assert via_run[0].finish_reason in ("constraint", "length") and via_run[1].finish_reason == "error"
    assert via_run[0].token_ids == via_engine[0].token_ids


class Interrupted(SMCSDModel):
    """A Ctrl-C arriving while the particles step (a ``KeyboardInterrupt`` inside a cycle)."""

    async def step(self):
        raise KeyboardInterrupt


def test_an_interrupt_inside_a_cycle_reaches_the_caller_once(tiny_smcsd, caplog):
    gc.collect()  # what earlier tests left is not this one's
    with pytest.raises(KeyboardInterrupt):
        tiny_smcsd.run([Interrupted("The cat")], CFG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()  # the interrupted cycle's tasks go: nothing may report them as well
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    assert [str(w.message) for w in caught] == []
    [out] = tiny_smcsd.run([SometimesIdle("The cat")], CFG)  # and the engine goes on
    assert out.token_ids

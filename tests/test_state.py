"""The state is a value: a step never writes what it was given; every resize is one gather
that keeps the evidence in the weights, as LLaMPPL does."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from helpers import EOS, chi_square_pvalue, config, exact_target, mock_pair, smc

from smcsd_ppl import smc as smc_math
from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.config import DraftRecord
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.rows import RowStore
from smcsd_ppl.inference.schedule import DraftSchedule
from smcsd_ppl.inference.state import reshape
from smcsd_ppl.inference.step import SMCSDKernel

W = [0.6, 0.3, 0.1]  # uneven: neither the first particle nor the heaviest is a fair draw
OFFSET = 5.0  # unnormalized log-weights
LOG_W = [math.log(w) + OFFSET for w in W]


class Waits(SMCSDModel):
    """A program whose step does nothing (so a step only reweighs and resizes it)."""

    async def step(self):
        pass


def waiting_state(schedule, seed=0):
    """A kernel and a state of one request: three distinct particles with weights ``LOG_W``."""
    kernel = SMCSDKernel(RowStore(MockLM(4), MockLM(4)), config(n_particles=3, cut=0.3), [EOS], str)
    state = kernel.init([Waits([1])], DraftRecord(), None)
    [pop] = state.populations
    particles = []
    for i in range(3):
        p = Waits([1])
        p.context.generated = [i]
        particles.append(p)
    pop = replace(pop, particles=tuple(particles), weights=tuple(LOG_W), schedule=schedule, seed=seed)
    return kernel, replace(state, populations=(pop,), cycle=1)


def stepped(kernel, state):
    return asyncio.run(kernel.step(state))[0]


def test_a_plain_request_going_alone_shrinks_to_one_particle_drawn_by_weight():
    alone = DraftSchedule(4, 3, plain=True, cost=0.3, failed=10.0).advanced()  # the draft does not pay
    counts = Counter()
    average = smc_math.log_mean_exp(torch.tensor(LOG_W, dtype=torch.float64))
    for seed in range(1500):
        kernel, state = waiting_state(alone, seed)
        [pop] = stepped(kernel, state).populations
        assert len(pop.particles) == 1 and pop.weights == (pytest.approx(average),)  # the evidence kept
        counts[pop.particles[0].token_ids[0]] += 1
    assert chi_square_pvalue(counts, dict(enumerate(W))) > 1e-3


def test_a_request_with_a_program_keeps_its_particles_and_weights():
    kernel, state = waiting_state(DraftSchedule(4, 3, plain=False, cost=0.3, failed=10.0).advanced())
    [pop] = stepped(kernel, state).populations
    assert [p.token_ids for p in pop.particles] == [[0], [1], [2]]
    assert pop.weights == pytest.approx(LOG_W)


def test_reshape_gathers_particles_and_rows_and_gives_each_the_average_weight():
    _, state = waiting_state(None)
    [pop] = state.populations
    out = reshape(pop, [0, 0, 2], pop.log_weights())
    assert [p.token_ids for p in out.particles] == [[0], [0], [2]]
    assert out.rows == (pop.rows[0], pop.rows[0], pop.rows[2])
    assert (
        out.weights == (pytest.approx(smc_math.log_mean_exp(torch.tensor(LOG_W, dtype=torch.float64))),) * 3
    )
    assert pop.weights == tuple(LOG_W)  # the population reshaped is unchanged


def fingerprint(state):
    """Everything a step could write, read out as plain values."""
    pops = []
    for pop in state.populations:
        particles = [
            (
                id(p),
                p.weight,
                p.finished,
                p.twist_amount,
                tuple(
                    (id(c), tuple(c.generated), c.row, id(c.runtime), c.mask is None) for c in p.contexts()
                ),
                id(p.runtime),
                id(p.last_block),
            )
            for p in pop.particles
        ]
        pops.append((pop.weights, pop.rows, pop.seed, pop.ess_trace, pop.schedule, particles))
    return state.cycle, state.idle, pops


class Twisting(SMCSDModel):
    """Extends and twists by its length: the step must untwist copies, not the particles it was given."""

    async def step(self):
        await self.extend()
        self.twist(0.1 * len(self.token_ids))


@pytest.mark.parametrize("cut", [None, 0.3])
def test_a_step_never_writes_the_state_it_was_given(cut):
    target, draft = mock_pair()
    kernel = SMCSDKernel(RowStore(target, draft), config(n_particles=4, max_new_tokens=16, cut=cut), [], str)
    state = kernel.init([SMCSDModel([1, 2]), Twisting([2]), SMCSDModel([0])], DraftRecord(), None)
    for cycle in range(1, 5):
        before = fingerprint(state)
        new, _ = asyncio.run(kernel.step(state))
        assert fingerprint(state) == before, f"step {cycle} wrote the state it was given"
        state = new
        if state.done:
            break
    assert cycle >= 3


def test_final_weights_keep_the_log_z_the_run_reports():
    target, draft = mock_pair()
    for r in smc(target, draft, [SMCSDModel([1, 2]) for _ in range(40)], max_new_tokens=4, ess_threshold=1.0):
        log_w = torch.tensor([p.log_weight for p in r.smc.particles], dtype=torch.float64)
        assert smc_math.log_mean_exp(log_w) == pytest.approx(r.smc.log_z, abs=1e-9)


# never, the default, (nearly) always; the fast tier runs one
@pytest.mark.parametrize(
    "threshold", [pytest.param(t, marks=[] if t == 1.0 else pytest.mark.slow) for t in (0.0, 0.5, 1.0)]
)
def test_the_final_weights_estimate_z_without_bias(threshold):
    # LLaMPPL's reading of a run: log-mean-exp of the particles' final weights estimates log Z,
    # whatever resampling did. Weights reset on resampling make this biased (the mutant).
    target, draft = mock_pair()
    runs = [SMCSDModel([1, 2]) for _ in range(1500)]
    results = smc(target, draft, runs, max_new_tokens=4, block_size=1, ess_threshold=threshold, seed=3)
    if threshold:
        assert sum(r.smc.n_resamples for r in results) > 0
    _, z = exact_target(target, [1, 2], 4)
    zs = torch.tensor(
        [
            math.exp(smc_math.log_mean_exp(torch.tensor([p.log_weight for p in r.smc.particles])))
            for r in results
        ],
        dtype=torch.float64,
    )
    stderr = float(zs.std() / math.sqrt(len(zs)))
    assert abs(float(zs.mean()) - z) < 4 * stderr + 1e-9, (float(zs.mean()), z, stderr)

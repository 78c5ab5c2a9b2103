"""Population changes: every resize draws in proportion to the weights and updates log Z once."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers import EOS, chi_square_pvalue, config

from smcsd_ppl import smc
from smcsd_ppl.backends.mock import MockLM
from smcsd_ppl.inference.program import SMCSDModel
from smcsd_ppl.inference.rows import RowStore
from smcsd_ppl.inference.schedule import DraftSchedule
from smcsd_ppl.inference.state import Population, reshape
from smcsd_ppl.inference.step import SMCSDKernel

W = [0.6, 0.3, 0.1]  # uneven: neither the first particle nor the heaviest is a fair draw
OFFSET = 5.0  # unnormalized log-weights


def population(schedule=None, log_z=1.0) -> Population:
    particles = []
    for i, w in enumerate(W):
        p = SMCSDModel([1])
        p.context.generated, p.context.row, p.weight = [i], i, math.log(w) + OFFSET
        particles.append(p)
    return Population(tuple(particles), log_z=log_z, schedule=schedule)


def test_a_plain_request_going_alone_shrinks_to_one_particle_drawn_by_weight():
    kernel = SMCSDKernel(RowStore(MockLM(4), MockLM(4)), config(n_particles=3, cut=0.3), [EOS], str)
    alone = DraftSchedule(4, 3, plain=True, cost=0.3, failed=10.0)  # the draft does not pay
    counts = Counter()
    increment = smc.log_mean_exp(torch.tensor([math.log(w) + OFFSET for w in W], dtype=torch.float64))
    for seed in range(3000):
        pop = kernel._resized(population(alone), torch.Generator().manual_seed(seed))
        assert len(pop.particles) == 1 and pop.particles[0].weight == 0.0
        assert pop.log_z == pytest.approx(1.0 + increment)  # the draw's log Z increment, once
        counts[pop.particles[0].token_ids[0]] += 1
    assert chi_square_pvalue(counts, dict(enumerate(W))) > 1e-3


def test_a_request_with_a_program_keeps_its_particles():
    kernel = SMCSDKernel(RowStore(MockLM(4), MockLM(4)), config(n_particles=3, cut=0.3), [EOS], str)
    alone = DraftSchedule(4, 3, plain=False, cost=0.3, failed=10.0)
    pop = kernel._resized(population(alone), torch.Generator().manual_seed(0))
    assert [p.weight for p in pop.particles] == [math.log(w) + OFFSET for w in W] and pop.log_z == 1.0


def test_reshape_copies_repeated_ancestors_and_resets_the_weights():
    pop = population()
    log_w = pop.log_weights()
    out = reshape(pop, [0, 0, 2], log_w)
    assert [p.token_ids for p in out.particles] == [[0], [0], [2]]
    assert out.particles[0] is not out.particles[1]  # a copy, not an alias
    assert all(p.weight == 0.0 for p in out.particles)
    assert out.log_z == pytest.approx(1.0 + smc.log_mean_exp(log_w))

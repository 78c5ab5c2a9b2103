"""Hugging Face's samplers draw from torch's global generator: ours leave the caller's as it was."""

from __future__ import annotations

import torch
from tiny import llama

from smcsd_ppl.config import SMCConfig
from smcsd_ppl.methods.hf import hf_generate
from smcsd_ppl.methods.hf_assisted import hf_speculative


def test_hugging_faces_samplers_leave_the_callers_global_generator_as_it_was():
    # generate() samples from the global generator: both runners seed it inside fork_rng, so a
    # caller's own stream goes on as if they had not run.
    model, config = llama(), SMCConfig(max_new_tokens=4, block_size=2)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    hf_generate(model, [1, 2, 3], max_new_tokens=4, temperature=1.0, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    hf_speculative(model, [[1, 2, 3]], config, [])
    assert torch.equal(torch.random.get_rng_state(), state)

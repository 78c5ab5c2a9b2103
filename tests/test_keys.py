"""Keys: one hash, a key per path, and every seeded stream of the package derived through it."""

from __future__ import annotations

import torch

from smcsd_ppl.keys import derive, generator


def test_a_key_depends_on_its_path_alone():
    assert derive(7, "request", 3) == derive(7, "request", 3)
    keys = {
        derive(7),
        derive(8),
        derive(7, "request", 3),
        derive(7, "request", 4),
        derive(7, "choose"),
        derive(7, "resample", 3),
        derive(7, 3, "request"),
        derive(-7, "request", 3),
        derive(7, "request", 3, 0),
    }
    assert len(keys) == 9  # distinct paths, distinct keys
    assert all(0 <= k < 2**63 for k in keys)  # a valid seed anywhere (torch, numpy, OpenAI's seed)
    # Names are hashed whole: a prefix or a reordering is another path.
    assert derive(0, "tokens") != derive(0, "token") != derive(0, "snekot")


def test_a_generator_is_its_key():
    a, b, c = (generator(derive(seed, "choose")) for seed in (1, 1, 2))
    first = torch.rand(4, generator=a)
    assert torch.equal(first, torch.rand(4, generator=b))
    assert not torch.equal(first, torch.rand(4, generator=c))

"""Hugging Face ``model.generate()``: the external reference for plain decoding speed."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel


def hf_generate(
    model: PreTrainedModel,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    exact_length: bool = False,
) -> tuple[list[int], float]:
    """Sample with ``model.generate`` (batch 1); returns new token ids and wall seconds.

    ``top_k=0`` and ``top_p=1`` keep the plain tempered distribution (the default
    top_k=50 would change it); ``exact_length`` forbids EOS so every run emits
    ``max_new_tokens`` tokens.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    # generate() samples from torch's global generator: seeded here, the caller's state restored.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **plain_sampling(temperature, max_new_tokens),
            min_new_tokens=max_new_tokens if exact_length else 0,
            pad_token_id=model.generation_config.eos_token_id,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return out[0, ids.shape[1] :].tolist(), time.perf_counter() - start


def plain_sampling(temperature: float, max_new_tokens: int) -> dict:
    """``generate()`` settings for sampling the tempered distribution itself (greedy at T = 0).

    The default ``top_k=50`` would truncate it; ``top_p=1`` keeps every token.
    """
    if temperature == 0:
        return dict(do_sample=False, max_new_tokens=max_new_tokens)
    return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens)

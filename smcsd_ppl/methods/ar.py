"""Autoregressive sampling from the target: the baseline every speed-up is measured against."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..backends.base import BatchedLM, check_finite
from ..results import Generation
from ..spec import sample_tokens
from .registry import register

NAN_CHECK_EVERY = 16  # forwards between checks for NaN logits (each check is a host read)


@dataclass
class TokenRun:
    """Token ids per request and what it cost."""

    token_ids: list[list[int]]
    target_calls: int


def autoregressive(
    target: BatchedLM,
    prompts: Sequence[Sequence[int]],
    *,
    eos_token_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    g: torch.Generator,
    on_step: Callable[[int], None] | None = None,
) -> TokenRun:
    """Sample each prompt's continuation one target forward per token, all prompts batched.

    Finished requests leave the batch (one gather), so they cost nothing afterwards.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    eos = set(int(e) for e in eos_token_ids)
    logits = target.prefill(prompts)  # [B, V]
    outs: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # request of each row
    calls = 1
    while True:
        tokens = sample_tokens(logits, temperature, g)  # [R]
        keep = []
        for i, (req, tok) in enumerate(zip(rows, tokens.tolist())):
            outs[req].append(tok)
            if tok not in eos and len(outs[req]) < max_new_tokens:
                keep.append(i)
        if on_step is not None:
            on_step(max(len(o) for o in outs))
        if not keep or calls % NAN_CHECK_EVERY == 0:  # NaN logits end the run a few tokens late
            check_finite(target)
        if not keep:
            return TokenRun(outs, calls)
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=tokens.device)
            target.fork(index)
            tokens = tokens.index_select(0, index)
            rows = [rows[i] for i in keep]
        logits = target.extend(tokens[:, None])[:, -1]
        calls += 1


@register("ar", uses_draft=False, summary="autoregressive sampling from the target")
def _ar(pair, ids, config, on_progress):
    g = torch.Generator(device=pair.target_lm.device).manual_seed(config.seed)
    run = autoregressive(
        pair.target_lm,
        ids,
        eos_token_ids=pair.eos_for(config),
        max_new_tokens=config.max_new_tokens,
        temperature=config.target_temperature,
        g=g,
        on_step=on_progress,
    )
    return [Generation(pair.decode(t), t, "ar", None) for t in run.token_ids]

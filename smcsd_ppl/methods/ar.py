"""Autoregressive decoding of the target: the baseline every speed-up is measured against.

Greedy at temperature 0 (the reference RACER must reproduce), else sampling at T_t.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..backends.base import BatchedLM, check_finite, to_device
from ..ends import row_ends
from ..results import Generation
from ..verification import sample_tokens
from .registry import RunContext, register

NAN_CHECK_EVERY = 16  # forwards between checks for NaN logits (each check is a host read)


def choose_tokens(logits: torch.Tensor, temperature: float, g: torch.Generator | None) -> torch.Tensor:
    """Argmax at temperature 0, else one draw per row of ``logits [N, V]`` at that temperature."""
    return logits.argmax(-1) if temperature == 0 else sample_tokens(logits, temperature, g)


def autoregressive(
    target: BatchedLM,
    prompts: Sequence[Sequence[int]],
    *,
    eos_token_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    g: torch.Generator | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Each prompt's continuation, one target forward per token, all prompts batched.

    Temperature 0 is greedy; above it, tokens are drawn from softmax(logits / T) with
    ``g``. Finished requests leave the batch (one gather), so they cost nothing afterwards.
    Returns the new token ids per prompt (an ending EOS included).
    """
    if temperature < 0 or (temperature > 0 and g is None):
        raise ValueError(f"temperature must be >= 0, and sampling (> 0) needs a generator; got {temperature}")
    eos = set(int(e) for e in eos_token_ids)
    logits = target.prefill(prompts)  # [B, V]
    outs: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # request of each row
    calls = 1
    while True:
        tokens = choose_tokens(logits, temperature, g)  # [R]
        keep = []
        for i, (req, tok) in enumerate(zip(rows, tokens.tolist())):
            outs[req].append(tok)
            if not row_ends(tok, len(outs[req]), max_new_tokens, eos):
                keep.append(i)
        if on_step is not None:
            on_step(max(len(o) for o in outs))
        if not keep or calls % NAN_CHECK_EVERY == 0:  # NaN logits end the run a few tokens late
            check_finite(target)
        if not keep:
            return outs
        if len(keep) < len(rows):
            index = torch.tensor(keep)  # on the host: the backend knows the rows without a read
            target.fork(index)
            tokens = tokens.index_select(0, to_device(index, tokens.device))
            rows = [rows[i] for i in keep]
        logits = target.extend(tokens[:, None])[:, -1]
        calls += 1


@register("ar", uses_draft=False)
def _ar(ctx: RunContext) -> list[Generation]:
    cfg = ctx.config
    tokens = autoregressive(
        ctx.target_lm,
        ctx.prompts,
        eos_token_ids=ctx.eos,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.target_temperature,
        g=torch.Generator(device=ctx.target_lm.device).manual_seed(cfg.seed),
        on_step=ctx.on_progress,
    )
    return ctx.generations(tokens)

"""Autoregressive decoding on the static path: one graph per token, one host read per token.

The step (forward, then the token drawn) is a pure function of tensors run through
``backends.graphs.Graphed``; the host reads the drawn tokens, to stop at EOS or the budget,
and nothing else. Rows that ended keep stepping (static shapes) and are ignored. The draws
are the eager runner's (``methods.ar``): one uniform per row per token from the caller's
generator, so a seeded request gives the eager path's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..backends.base import Timer, check_prompts, pad_left
from ..backends.static import Arena, StaticLlama
from ..ends import row_ends
from ..verification import inverse_cdf

NAN_CHECK_EVERY = 16  # steps between reads of the NaN flag, as the eager runner


def choose(logits: torch.Tensor, temperature: float, u: torch.Tensor) -> torch.Tensor:
    """Argmax at temperature 0, else the inverse-CDF draw of softmax(logits / T) at ``u [R]``."""
    if temperature == 0:
        return logits.argmax(-1)
    return inverse_cdf(torch.softmax(logits.float() / temperature, -1), u)


def ar_step(model: StaticLlama, temperature: float) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The step ``(*arena.flat(), tokens [R], u [R]) -> (next [R], NaN seen [])``."""

    def step(*args):
        arena, tokens, u = Arena.of(args[:-2]), args[-2], args[-1]
        valid = torch.ones_like(tokens, dtype=torch.bool)[:, None]
        logits = model.forward(arena, tokens[:, None], valid, last_only=True)[:, -1]
        return choose(logits, temperature, u), torch.isnan(logits).any()

    return step


@torch.inference_mode()
def static_autoregressive(
    engine,
    prompts: Sequence[Sequence[int]],
    *,
    eos_token_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    g: torch.Generator | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Each prompt's continuation, as ``methods.ar.autoregressive`` gives it, on ``engine``'s graphs.

    ``engine`` is a ``inference.static_engine.StaticEngine``. Returns the new token ids per
    prompt (an ending EOS included).
    """
    model: StaticLlama = engine.target
    check_prompts(prompts, model.max_length)
    eos = {int(e) for e in eos_token_ids}
    width = max(len(p) for p in prompts) + max_new_tokens + 1
    arena = engine.arena("target", len(prompts), width)
    ids, valid = pad_left(prompts, model.device)
    with Timer(engine.target_stats, model.device, ids.numel()):
        logits = model.forward(arena, ids, valid, last_only=True)[:, -1]  # prefill: eager, any length
    step = engine.graph(("ar", temperature), lambda: ar_step(model, temperature))
    outs: list[list[int]] = [[] for _ in prompts]
    live = [True] * len(prompts)
    tokens = choose(logits, temperature, _uniforms(g, len(prompts), model.device, temperature))
    calls = 1
    while True:
        host = tokens.tolist()  # the one read of the step
        for i, tok in enumerate(host):
            if live[i]:
                outs[i].append(tok)
                live[i] = not row_ends(tok, len(outs[i]), max_new_tokens, eos)
        if on_step is not None:
            on_step(max(len(o) for o in outs))
        if not any(live) or calls % NAN_CHECK_EVERY == 0:  # NaN logits end the run a few tokens late
            engine.check_finite()
        if not any(live):
            return outs
        u = _uniforms(g, sum(live), model.device, temperature)
        draws = torch.zeros(len(prompts), device=model.device)
        draws[[i for i, a in enumerate(live) if a]] = u  # ended rows step on, unread
        with Timer(engine.target_stats, model.device, len(prompts)):
            tokens, nan = step(*arena.flat(), tokens, draws)
        engine.flag_nan(nan)
        calls += 1


def _uniforms(g: torch.Generator | None, n: int, device: torch.device, temperature: float) -> torch.Tensor:
    """The eager runner's draws: ``n`` uniforms from ``g`` (none needed when greedy)."""
    if temperature == 0:
        return torch.zeros(n, device=device)
    if g is None:
        raise ValueError("sampling (temperature > 0) needs a generator")
    return torch.rand(n, generator=g, device=device)

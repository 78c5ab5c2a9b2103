"""The target's log-probabilities of a request's tokens, and of the likeliest tokens at each place.

What a client asks for with ``logprobs`` (the output's) and ``prompt_logprobs`` or ``echo`` (the
prompt's): one plain forward of the target over prompt and output, after the request finished,
so the numbers are the target's own at the request's temperature (``log softmax(logits / T_t)``;
greedy's, T_t = 0, are the model's own at T = 1), whatever proposed the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..results import Generation

MAX_TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's limit)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target, its rank there (1: the likeliest) and the ``top``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 1


def scored(
    model,
    prompt: Sequence[int],
    gen: Generation,
    *,
    temperature: float,
    top: int | None,
    prompt_top: int | None,
) -> Generation:
    """``gen`` with the log-probabilities asked for, from one forward over prompt and output.

    ``top``: its tokens', with this many alternatives at each; ``prompt_top``: its prompt's after
    the first token; None: not asked.
    """
    start = 1 if prompt_top is not None else len(prompt)
    most = max(top or 0, prompt_top or 0)
    scores = sequence_logprobs(model, [*prompt, *gen.token_ids], start, temperature or 1.0, most)
    split = len(prompt) - start
    return replace(
        gen,
        logprobs=None if top is None else _trimmed(scores[split:], top),
        prompt_logprobs=None if prompt_top is None else _trimmed(scores[:split], prompt_top),
    )


def _trimmed(scores: tuple[TokenLogprob, ...], top: int) -> tuple[TokenLogprob, ...]:
    return tuple(replace(s, top=s.top[:top]) for s in scores)


def sequence_logprobs(
    model, ids: Sequence[int], start: int, temperature: float, top: int
) -> tuple[TokenLogprob, ...]:
    """Each of ``ids[start:]``' log-probability after the ids before it, from one forward (``start >= 1``)."""
    if start >= len(ids):
        return ()
    device = model.get_input_embeddings().weight.device
    row = torch.tensor([list(ids)], device=device)
    with torch.inference_mode():
        logits = model(input_ids=row, use_cache=False).logits[0, start - 1 : -1]
        log_p = torch.log_softmax(logits.float().div_(temperature), -1)
        chosen = log_p.gather(1, row[0, start:, None])
        ranks = (log_p > chosen).sum(-1) + 1
    best = log_p.topk(top, -1) if top else None
    tops = (
        [()] * len(chosen)
        if best is None
        else [tuple(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
    )
    scored = zip(ids[start:], chosen[:, 0].tolist(), tops, ranks.tolist())
    return tuple(TokenLogprob(int(t), c, k, r) for t, c, k, r in scored)

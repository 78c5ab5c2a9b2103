"""The target's log-probabilities of an output's tokens, and of the likeliest tokens at each place.

What a client asks for with ``logprobs``: one plain forward of the target over prompt and output,
after the request finished, so the numbers are the target's own at the request's temperature
(``log softmax(logits / T_t)``), whatever proposed the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's limit)


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the target, and the ``top`` likeliest there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    model, prompt_ids: Sequence[int], token_ids: Sequence[int], temperature: float, top: int
) -> tuple[TokenLogprob, ...]:
    """Each of ``token_ids``' log-probability after ``prompt_ids`` and the tokens before it.

    Args:
        model: the target, a causal LM in PyTorch.
        prompt_ids: the prompt's token ids (at least one).
        token_ids: the output's.
        temperature: T_t: the log-probabilities are those of ``softmax(logits / T_t)``.
        top: how many likeliest tokens (with theirs) to give at each place, 0 to 20.
    """
    if not token_ids:
        return ()
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([[*prompt_ids, *token_ids]], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1]
    log_p = torch.log_softmax(logits.float() / temperature, -1)
    chosen = log_p.gather(1, ids[0, len(prompt_ids) :, None])[:, 0].tolist()
    best = log_p.topk(top, -1) if top else None
    tops = (
        [()] * len(chosen)
        if best is None
        else [tuple(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
    )
    return tuple(TokenLogprob(int(t), c, k) for t, c, k in zip(token_ids, chosen, tops))

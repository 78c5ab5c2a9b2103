"""Answers that carry their prompts' scores: ``echo``, ``prompt_logprobs`` and ``max_tokens`` 0.

What evaluation harnesses send to score a text (lm-evaluation-harness's ``local-completions``
asks ``echo`` with ``logprobs`` and reads the prompt's log-probabilities). The engine scores the
prompt in the same target forward as the output (``engine.scoring``); here the answer is shaped:
OpenAI's echo (the prompt's text and tokens first, the first token with no log-probability) and
vLLM's ``prompt_logprobs`` (per prompt token after the first, its own and the likeliest, with
their ranks).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from ..engine.scoring import TokenLogprob
from .responses import Answer, logprobs_field, usage


def scored_response(call, answer: Answer, gens, reasons, prompt_ids, decode, token_text, fields) -> dict:
    """The whole answer of a scoring ``call``, its choices' ``Generation``s ``gens`` (prompt-major).

    ``reasons``: each choice's finish reason; ``decode``: token ids -> text; ``token_text``: a
    token id -> its name in ``logprobs``; ``fields``: (``Generation``, choice index) -> the
    ``smcsd`` and ``logprobs`` a choice carries.
    """
    choices, completion_tokens = [], 0
    for i, gen in enumerate(gens):
        ids = prompt_ids[i // call.n]
        reason = None
        if not call.generates:  # the prompt's scores alone: the drawn token is not returned
            gen, reason = replace(gen, text="", token_ids=[], logprobs=gen.logprobs and ()), "length"
        completion_tokens += len(gen.token_ids)
        extra = fields(gen, i)
        text = gen.text
        if call.echo:
            prompt = call.prompts[i // call.n]
            text = (prompt if isinstance(prompt, str) else decode(ids)) + text
            if gen.logprobs is not None:
                extra["logprobs"] = echoed_logprobs(ids[0], gen.prompt_logprobs, gen.logprobs, token_text)
        choice = answer.choice(i, text, reason or reasons[i], **extra)
        if call.prompt_logprobs is not None and answer.kind == "completion":
            choice["prompt_logprobs"] = prompt_logprobs_field(
                gen.prompt_logprobs, call.prompt_logprobs, token_text
            )
        choices.append(choice)
    prompt_tokens = sum(len(ids) for ids in prompt_ids)
    body = answer.response(choices, usage(prompt_tokens, completion_tokens))
    if call.prompt_logprobs is not None and answer.kind == "chat":  # vLLM gives chat's at the top
        body["prompt_logprobs"] = prompt_logprobs_field(
            gens[0].prompt_logprobs, call.prompt_logprobs, token_text
        )
    return body


def echoed_logprobs(
    first: int, prompt: tuple[TokenLogprob, ...], output: tuple[TokenLogprob, ...], name
) -> dict:
    """Completions' ``logprobs`` of the prompt's tokens, then the output's (the first token: null)."""
    scored = logprobs_field("completion", (*prompt, *output), name)
    tokens = [name(first), *scored["tokens"]]
    return {
        "tokens": tokens,
        "token_logprobs": [None, *scored["token_logprobs"]],
        "top_logprobs": [None, *scored["top_logprobs"]],
        "text_offset": [0, *itertools.accumulate(len(t) for t in tokens)][: len(tokens)],
    }


def prompt_logprobs_field(scores: tuple[TokenLogprob, ...], top: int, name) -> list:
    """The ``prompt_logprobs`` field (vLLM's): null for the first token, then its own and the ``top``."""
    out: list = [None]
    for s in scores:
        entries = {s.token_id: (s.logprob, s.rank)} | {
            t: (lp, rank) for rank, (t, lp) in enumerate(s.top[:top], 1) if t != s.token_id
        }
        out.append(
            {
                str(t): {"logprob": lp, "rank": rank, "decoded_token": name(t)}
                for t, (lp, rank) in entries.items()
            }
        )
    return out

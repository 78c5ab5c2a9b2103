"""OpenAI-shaped response bodies and stream chunks, with SMC-SD's diagnostics in a ``smcsd`` field."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..results import Generation
from .tools import ToolChoice

# Each kind of endpoint: the object names of its response and its chunks.
OBJECTS = {
    "chat": ("chat.completion", "chat.completion.chunk"),
    "completion": ("text_completion", "text_completion"),
}


@dataclass(frozen=True)
class Answer:
    """What one HTTP request's responses share: its kind (``"chat"``/``"completion"``), id, time and model."""

    kind: str
    id: str
    created: int
    model: str
    tool: ToolChoice | None = None  # the tool call a chat request asks for

    def call_id(self, index: int) -> str:
        """The id of choice ``index``'s tool call."""
        return f"call_{self.id.rsplit('-', 1)[-1][:20]}{index}"

    def head(self, chunk: bool = False) -> dict:
        """The fields every body and chunk starts with."""
        return {
            "id": self.id,
            "object": OBJECTS[self.kind][chunk],
            "created": self.created,
            "model": self.model,
        }

    def response(self, choices: list[dict], usage: dict) -> dict:
        """The whole (non-streamed) response."""
        return self.head() | {"choices": choices, "usage": usage, "system_fingerprint": None}

    def choice(
        self, index: int, text: str, finish_reason: str | None, smcsd: dict, logprobs: dict | None = None
    ) -> dict:
        """One finished choice of a non-streamed response (``logprobs``: ``logprobs_field``'s)."""
        body = {"message": {"role": "assistant", "content": text}} if self.kind == "chat" else {"text": text}
        choice = (
            {"index": index} | body | {"finish_reason": finish_reason, "logprobs": logprobs, "smcsd": smcsd}
        )
        return choice if self.tool is None else self.tool.answered(choice, text, self.call_id(index))

    def chunk(
        self,
        index: int,
        text: str,
        *,
        first: bool = False,
        finish_reason: str | None = None,
        smcsd: dict | None = None,
        logprobs: dict | None = None,
        whole: str | None = None,
    ) -> dict:
        """One choice's piece of a stream; the first chat chunk names the role, the last the finish reason.

        The last also carries the choice's log-probabilities, if asked: they come once the request
        has finished (``engine.scoring``), as ``smcsd`` does; and, under ``tool``, its whole output
        ``whole`` (a ``"required"`` call is sent whole there).
        """
        if self.tool is not None:
            body = {"delta": self.tool.delta(text, self.call_id(index), first=first, whole=whole)}
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        elif self.kind == "chat":
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            body = {"delta": delta}
        else:
            body = {"text": text}
        choice = {"index": index} | body | {"finish_reason": finish_reason, "logprobs": logprobs}
        if smcsd is not None:
            choice["smcsd"] = smcsd
        return self.head(chunk=True) | {"choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        """The chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
        return self.head(chunk=True) | {"choices": [], "usage": usage}


def logprobs_field(kind: str, scores, token_text) -> dict | None:
    """OpenAI's ``logprobs`` of a choice from its ``TokenLogprob``s (None: not asked).

    Chat gives ``content``: per token its text, bytes, log-probability and ``top_logprobs``;
    completions the older shape: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per
    token) and ``text_offset``. ``token_text``: a token id -> its text.
    """
    if scores is None:
        return None
    if kind == "chat":

        def entry(token: int, logprob: float) -> dict:
            text = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            entry(s.token_id, s.logprob) | {"top_logprobs": [entry(*t) for t in s.top]} for s in scores
        ]
        return {"content": content, "refusal": None}
    tokens = [token_text(s.token_id) for s in scores]
    offsets = [0, *itertools.accumulate(len(t) for t in tokens)][: len(tokens)]  # where each begins
    return {
        "tokens": tokens,
        "token_logprobs": [s.logprob for s in scores],
        "top_logprobs": [{token_text(t): lp for t, lp in s.top} for s in scores],
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage field."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def request_usage(tickets, n: int) -> dict:
    """Usage of a request's finished tickets (prompt-major): each prompt counted once, not once per choice."""
    prompts = sum(t.prompt_tokens for t in tickets[::n])
    return usage(prompts, sum(t.completion_tokens for t in tickets))


def diagnostics(gen: Generation, request) -> dict:
    """The ``smcsd`` extension of one choice: the settings that reproduce it and SMC-SD's report.

    Non-finite numbers (log Z of an output whose particles all died) become null, as JSON has none.
    """
    c = request.config
    out: dict = {
        "method": gen.method,
        "seed": c.seed,
        "n_particles": c.n_particles,
        "block_size": c.block_size,
        "twist": c.twist,  # how a constraint was twisted (None: not at all)
    }
    smc, stats = gen.smc, gen.stats
    if smc is not None:
        out |= {
            "log_z": _finite(smc.log_z),
            "mean_ess": _finite(smc.mean_ess),
            "n_resamples": smc.n_resamples,
            "collapsed": smc.collapsed,
        }
    if stats is not None:
        out |= {
            "tokens_per_target_call": _finite(stats.tokens_per_target_call),
            "target_calls": stats.target_calls,
        }
    return out | {"finish_reason": str(gen.finish_reason), "message": gen.message}


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None

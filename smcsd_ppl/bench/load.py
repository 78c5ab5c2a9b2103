"""A load test of ``smcsd serve`` with the official ``openai`` client, and the engine's own ceiling.

One fixed set of requests (streamed or not, constrained or not, each with its own seed) is sent
at each concurrency level by that many client threads taking the next request as they finish one;
level 1 is the same requests sent one after another. Every answer is checked to be its request's
(each answered once, its seed echoed back, its prompt's token count, a constrained answer naming
its request), and compared with the level-1 answer of the same seed. The ceiling is the same
requests as one ``pair.run`` batch in the same process.
"""

from __future__ import annotations

import queue
import re
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TOPICS = ("the sea", "a mountain", "bread", "a violin", "rain", "a library", "the moon", "a garden")


@dataclass(frozen=True)
class LoadRequest:
    """One request of the workload.

    Attributes:
        index: its number, which its prompt (and a constrained answer) names.
        seed: its seed (unique in the workload).
        stream: sent with ``stream=True``.
        constrained: its answer must match ``pattern``.
    """

    index: int
    seed: int
    stream: bool
    constrained: bool

    @property
    def prompt(self) -> str:
        """The user message: asks for something this request alone asks for."""
        topic = TOPICS[self.index % len(TOPICS)]
        return f"Start your answer with 'Request {self.index}:' and then write one sentence about {topic}."

    @property
    def pattern(self) -> str | None:
        """The regex a constrained answer matches: it starts by naming its request."""
        return rf"Request {self.index}: [A-Za-z ,']+\." if self.constrained else None


def workload(count: int, seed: int = 0) -> list[LoadRequest]:
    """``count`` requests: every other one streamed, one in four constrained, seeds ``seed + index``."""
    return [LoadRequest(i, seed + i, stream=i % 2 == 0, constrained=i % 4 in (1, 2)) for i in range(count)]


@dataclass(frozen=True)
class Target:
    """Where and how to send the requests: the server's ``/v1`` URL, key, model and settings."""

    base_url: str
    model: str
    max_tokens: int
    temperature: float
    draft_temperature: float
    n_particles: int
    block_size: int
    api_key: str = "none"


def send(client, target: Target, request: LoadRequest) -> dict:
    """Send one request; its record: timings, the answer and what identifies it (or the error)."""
    extra = {
        "n_particles": target.n_particles,
        "block_size": target.block_size,
        "draft_temperature": target.draft_temperature,
    }
    if request.pattern:
        extra["regex"] = request.pattern
    ask = dict(
        model=target.model,
        messages=[{"role": "user", "content": request.prompt}],
        max_tokens=target.max_tokens,
        temperature=target.temperature,
        seed=request.seed,
        extra_body=extra,
    )
    record = {"index": request.index, "seed": request.seed, "stream": request.stream}
    record["constrained"], start = request.constrained, time.perf_counter()
    try:
        answer = _streamed(client, ask, start) if request.stream else _whole(client, ask)
    except Exception as err:  # counted as a failed request, not a crash of the test
        return record | {"error": f"{type(err).__name__}: {err}", "latency": time.perf_counter() - start}
    return record | answer | {"latency": time.perf_counter() - start}


def _whole(client, ask: dict) -> dict:
    out = client.chat.completions.create(**ask)
    [choice] = out.choices
    return {
        "text": choice.message.content,
        "finish_reason": choice.finish_reason,
        "echoed_seed": choice.model_extra["smcsd"]["seed"],
        "prompt_tokens": out.usage.prompt_tokens,
        "completion_tokens": out.usage.completion_tokens,
        "ttft": None,
    }


def _streamed(client, ask: dict, start: float) -> dict:
    text, first, last = [], None, None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter() - start
                text.append(choice.delta.content)
            if choice.finish_reason:
                last = choice
    usage = chunk.usage.model_dump()  # the server puts usage on the last chunk
    return {
        "text": "".join(text),
        "finish_reason": last.finish_reason,
        "echoed_seed": last.model_extra["smcsd"]["seed"],
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "ttft": first,
    }


def run_level(target: Target, requests: Sequence[LoadRequest], clients: int) -> tuple[list[dict], float]:
    """Send every request through ``clients`` concurrent clients; the records and the wall seconds."""
    import openai

    todo: queue.Queue = queue.Queue()
    for r in requests:
        todo.put(r)
    records: list[dict] = []

    def client_loop() -> None:
        client = openai.OpenAI(base_url=target.base_url, api_key=target.api_key, max_retries=0, timeout=600)
        while True:
            try:
                request = todo.get_nowait()
            except queue.Empty:
                return
            records.append(send(client, target, request) | {"clients": clients})

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(records, key=lambda r: r["index"]), time.perf_counter() - start


def check_answers(
    records: list[dict], requests: Sequence[LoadRequest], reference: dict[int, dict]
) -> list[str]:
    """What is wrong with a level's answers: missing, doubled, failed, or not its request's."""
    problems = []
    seen = [r["index"] for r in records]
    if sorted(seen) != [r.index for r in requests]:
        problems.append(f"requests answered {seen}, expected each of 0..{len(requests) - 1} once")
    by_index = {r.index: r for r in requests}
    for rec in records:
        want, ref = by_index[rec["index"]], reference.get(rec["index"])
        if "error" in rec:
            problems.append(f"request {rec['index']} failed: {rec['error']}")
        elif rec["echoed_seed"] != want.seed:
            problems.append(f"request {rec['index']} got the answer of seed {rec['echoed_seed']}")
        elif ref is not None and rec["prompt_tokens"] != ref["prompt_tokens"]:
            problems.append(f"request {rec['index']} reports another prompt's {rec['prompt_tokens']} tokens")
        elif want.pattern and rec["finish_reason"] == "stop" and not re.fullmatch(want.pattern, rec["text"]):
            problems.append(f"request {rec['index']}'s constrained answer {rec['text']!r} is not its own")
    return problems


def summarize_level(clients: int, records: list[dict], seconds: float, reference: dict[int, dict]) -> dict:
    """A level's throughput, latency and time to first token, and how many answers match level 1's."""
    ok = [r for r in records if "error" not in r]
    latencies = sorted(r["latency"] for r in ok)
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    tokens = sum(r["completion_tokens"] for r in ok)
    same = [r["text"] == reference[r["index"]]["text"] for r in ok if r["index"] in reference]
    return {
        "kind": "level",
        "clients": clients,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "requests_per_second": len(ok) / seconds if seconds else 0.0,
        "latency_p50": _quantile(latencies, 0.5),
        "latency_p95": _quantile(latencies, 0.95),
        "ttft_p50": _quantile(ttfts, 0.5),
        "same_as_sequential": sum(same) / len(same) if same else None,
    }


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[round(q * 100) - 1]


def ceiling(engine, config, requests: Sequence[LoadRequest]) -> dict:
    """The same requests given to the server's engine at once (one seed for all): its own throughput.

    One batch, no HTTP in between: what one ``pair.run`` of them measures.
    """
    from ..engine.client import ServeRequest
    from ..potentials.spec import ConstraintSpec

    asks = []
    for r in requests:
        messages = [{"role": "user", "content": r.prompt}]
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        spec = ConstraintSpec("regex", r.pattern) if r.pattern else None
        asks.append(ServeRequest([int(t) for t in ids], config, constraint=spec))
    start = time.perf_counter()
    outs = [t.wait() for t in [engine.submit(a) for a in asks]]
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "kind": "ceiling",
        "requests": len(requests),
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
    }


def run_load(
    target: Target,
    requests: Sequence[LoadRequest],
    levels: Sequence[int],
    on_level: Callable[[dict], None] | None = None,
) -> tuple[list[dict], list[dict], list[str]]:
    """Every level (level 1 first: the sequential reference); request records, level summaries, problems."""
    import openai

    warm = openai.OpenAI(base_url=target.base_url, api_key=target.api_key, max_retries=0)
    send(warm, target, LoadRequest(len(requests), 10**9, stream=False, constrained=False))  # first-call costs
    records, summaries, problems, reference = [], [], [], {}
    for clients in sorted(set(levels) | {1}):
        level, seconds = run_level(target, requests, clients)
        if clients == 1:
            reference = {r["index"]: r for r in level if "error" not in r}
        problems += [f"{clients} clients: {p}" for p in check_answers(level, requests, reference)]
        summary = summarize_level(clients, level, seconds, reference)
        records += level
        summaries.append(summary)
        if on_level is not None:
            on_level(summary)
    return records, summaries, problems

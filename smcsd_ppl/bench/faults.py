"""A load test with faults: good requests mixed with broken ones and an overload burst, round after round.

Clients send, concurrently, good requests (chat, streamed, JSON Schema) and faults (a stream
dropped after two chunks, a body that is not JSON, an invalid schema, ``max_tokens: -1``, a
temperature that is a word, an unknown model, a 60,000-character prompt), then all at once a
burst of good requests. Every answer is filed by kind and status; a request that does not
answer within the timeout is a hang. After each round the server must be idle again (queue,
running and rows gauges at 0 within a second), and the server's resident memory is read, so
that a long soak shows whether it levels off.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

GOOD = ("chat", "stream", "schema")
FAULTS = (
    "dropped_stream",
    "not_json",
    "bad_schema",
    "negative_max_tokens",
    "word_temperature",
    "unknown_model",
    "huge_prompt",
)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@dataclass(frozen=True)
class Server:
    """Where the load goes: the server's root URL (no ``/v1``), its model, the requests' budget, its key."""

    url: str
    model: str
    max_tokens: int
    api_key: str | None = None


def body_of(kind: str, server: Server, seed: int) -> tuple[bytes, bool]:
    """The request body of one request of ``kind`` (bytes, as sent) and whether it is streamed."""
    ask = {
        "model": server.model,
        "messages": [{"role": "user", "content": f"Say something about the number {seed}."}],
        "max_tokens": server.max_tokens,
        "seed": seed,
    }
    if kind == "not_json":
        return b'{"model": "x", "messages": [', False
    if kind == "schema":
        ask["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        ask["messages"][0]["content"] = f"Invent a person aged {seed % 90}; answer in JSON."
    elif kind == "bad_schema":
        ask["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "strin"}},
        }
    elif kind == "negative_max_tokens":
        ask["max_tokens"] = -1
    elif kind == "word_temperature":
        ask["temperature"] = "hot"
    elif kind == "unknown_model":
        ask["model"] = "no-such-model"
    elif kind == "huge_prompt":
        ask["messages"][0]["content"] = "word " * 12_000
    stream = kind in ("stream", "dropped_stream")
    return json.dumps(ask | ({"stream": True} if stream else {})).encode(), stream


def send(client, server: Server, kind: str, seed: int, timeout: float) -> dict:
    """Send one request; its record: kind, status (None: a hang), latency, and a dropped stream's chunks."""
    import httpx

    body, stream = body_of(kind, server, seed)
    headers = {"content-type": "application/json"}
    if server.api_key:
        headers["authorization"] = f"Bearer {server.api_key}"
    start, record = time.perf_counter(), {"kind": "request", "request": kind, "seed": seed}
    try:
        if stream:
            with client.stream(
                "POST", f"{server.url}/v1/chat/completions", content=body, headers=headers, timeout=timeout
            ) as reply:
                chunks = 0
                for line in reply.iter_lines():
                    chunks += line.startswith("data:")
                    if kind == "dropped_stream" and chunks >= 2:
                        break  # the client walks away mid-stream
                record |= {"status": reply.status_code, "chunks": chunks}
        else:
            reply = client.post(
                f"{server.url}/v1/chat/completions", content=body, headers=headers, timeout=timeout
            )
            record["status"] = reply.status_code
            if kind == "schema" and reply.status_code == 200:
                choice = reply.json()["choices"][0]
                record["finish_reason"] = choice["finish_reason"]
                if choice["finish_reason"] == "stop":  # complete: it must hold to the schema
                    record["valid"] = _valid(choice["message"]["content"])
    except httpx.TimeoutException:
        record["status"] = None
    except httpx.HTTPError as err:
        record |= {"status": None, "error": f"{type(err).__name__}: {err}"}
    return record | {"latency": time.perf_counter() - start}


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("age"), int)
    )


def run_round(
    server: Server, clients: int, per_client: int, burst: int, seed: int, timeout: float
) -> list[dict]:
    """One round: ``clients`` clients send ``per_client`` requests each, of mixed kinds; then a burst."""
    import httpx

    rng = random.Random(seed)
    kinds = [rng.choice(GOOD + FAULTS) for _ in range(clients * per_client)]
    records: list[dict] = []

    def client_loop(mine: Sequence[tuple[int, str]]) -> None:
        with httpx.Client() as client:
            for i, kind in mine:
                records.append(send(client, server, kind, seed * 100_000 + i, timeout))

    work = list(enumerate(kinds))
    _together([lambda part=work[c::clients]: client_loop(part) for c in range(clients)])
    burst_records: list[dict] = []

    def one(i: int) -> None:
        with httpx.Client() as client:
            burst_records.append(
                send(client, server, "chat", seed * 100_000 + 50_000 + i, timeout) | {"burst": True}
            )

    _together([lambda i=i: one(i) for i in range(burst)])
    return records + burst_records


def _together(calls: Sequence[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=c) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def gauges_after(server: Server, within: float = 1.0) -> dict:
    """The queue, running and rows gauges, polled until all are 0 or ``within`` seconds have passed."""
    import httpx

    names = ("smcsd_queue_depth", "smcsd_requests_running", "smcsd_rows_in_use")
    deadline = time.monotonic() + within
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        values = {n: _sample(text, n) for n in names}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def resident_mb(pids: Sequence[int]) -> float:
    """The resident memory of the given processes together, in MB."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration):
            pass
    return total


def summarize(records: Sequence[dict]) -> list[dict]:
    """Per request kind: how many, the status codes, p50/p99 latency, 5xx, hangs (and burst refusals)."""
    rows = []
    for kind in [*GOOD, *FAULTS, "burst"]:
        mine = [
            r
            for r in records
            if (r.get("burst") and kind == "burst") or (r["request"] == kind and not r.get("burst"))
        ]
        if not mine:
            continue
        latencies = sorted(r["latency"] for r in mine if r["status"] is not None)
        codes: dict[str, int] = {}
        for r in mine:
            codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
        refused = [r["latency"] for r in mine if r["status"] == 429]
        rows.append(
            {
                "kind": kind,
                "count": len(mine),
                "codes": dict(sorted(codes.items())),
                "p50": _quantile(latencies, 0.5),
                "p99": _quantile(latencies, 0.99),
                "5xx": sum(1 for r in mine if r["status"] is not None and r["status"] >= 500),
                "hangs": sum(1 for r in mine if r["status"] is None),
                "slowest_refusal": max(refused, default=None),
                "invalid": sum(1 for r in mine if r.get("valid") is False),
            }
        )
    return rows


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def fault_table(rows: Sequence[dict], rounds: Sequence[dict]) -> str:
    """Markdown: kinds x codes, latencies, 5xx and hangs; then each round's gauges after and memory."""
    lines = [
        "| kind | requests | status codes | p50 (s) | p99 (s) | 5xx | hangs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        codes = ", ".join(f"{c}: {n}" for c, n in r["codes"].items())
        p50 = "-" if r["p50"] is None else f"{r['p50']:.2f}"
        p99 = "-" if r["p99"] is None else f"{r['p99']:.2f}"
        lines.append(f"| {r['kind']} | {r['count']} | {codes} | {p50} | {p99} | {r['5xx']} | {r['hangs']} |")
    lines += ["", "| round | queue / running / rows after | server RSS (MB) |", "|---|---|---|"]
    for r in rounds:
        g = r["gauges"]
        after = f"{g['smcsd_queue_depth']:g} / {g['smcsd_requests_running']:g} / {g['smcsd_rows_in_use']:g}"
        lines.append(f"| {r['round']} | {after} | {r['rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def problems(rows: Sequence[dict], rounds: Sequence[dict]) -> list[str]:
    """What a sound server never does: a 5xx, a hang, an answer off its schema, no idle after a round."""
    out = [f"{r['kind']}: {r['5xx']} answers with 5xx" for r in rows if r["5xx"]]
    out += [f"{r['kind']}: {r['hangs']} hangs" for r in rows if r["hangs"]]
    out += [f"{r['kind']}: {r['invalid']} answers not valid for the schema" for r in rows if r["invalid"]]
    out += [
        f"round {r['round']}: not idle after ({r['gauges']})" for r in rounds if any(r["gauges"].values())
    ]
    return out


def soak_levels_off(rounds: Sequence[dict], last: int = 5, tolerance: float = 0.05) -> bool:
    """Whether the last ``last`` rounds' memory lies within ``tolerance`` of their median."""
    tail = [r["rss_mb"] for r in rounds[-last:]]
    mid = statistics.median(tail)
    return len(tail) == last and all(abs(x - mid) <= tolerance * mid for x in tail)

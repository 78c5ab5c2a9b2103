"""Methods interleaved call by call in one process, as users run them: does a call depend on what ran before?

The calls follow a de Bruijn sequence of the methods, so that within each block every method
runs right after every method (itself included) exactly once, all on the block's one prompt.
Blocks take the prompts forward then backward, so the first half of the run and the second
see the same prompts. From the records: each method's time per token right after each other
method against right after itself (the median over blocks of the per-block ratio), the first
calls of each method against its last, and the process's resident memory call by call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..batch.prompts import Prompt
from ..config import SMCConfig


def de_bruijn(k: int) -> list[int]:
    """A sequence over ``0..k-1`` in which every ordered pair (a, b) follows once: k*k + 1 long."""
    if k == 1:
        return [0, 0]
    seq, a = [], [0] * 3

    def walk(t: int, p: int) -> None:  # the FKM algorithm for order 2
        if t > 2:
            if 2 % p == 0:
                seq.extend(a[1 : p + 1])
            return
        a[t] = a[t - p]
        walk(t + 1, p)
        for j in range(a[t - p] + 1, k):
            a[t] = j
            walk(t + 1, t)

    walk(1, 1)
    return seq + seq[:1]  # closed: the last pair wraps to the first symbol


@dataclass(frozen=True)
class Call:
    """One planned call: its place, its block, the method, the one before, the prompt."""

    index: int
    block: int
    method: str
    previous: str | None
    prompt: Prompt


def plan_calls(methods: Sequence[str], prompts: Sequence[Prompt], blocks: int) -> list[Call]:
    """``blocks`` de Bruijn blocks of ``methods``; block b runs prompt ``order[b]`` (forward, then back)."""
    order = list(range(len(prompts)))
    order = (order + order[::-1]) * (-(-blocks // (2 * len(prompts))))
    calls, previous = [], None
    for b in range(blocks):
        for m in de_bruijn(len(methods)):
            calls.append(Call(len(calls), b, methods[m], previous, prompts[order[b]]))
            previous = methods[m]
    return calls


def resident_mb() -> float:
    """The process's resident memory now, in MB (0 where ``/proc`` cannot tell)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_calls(pair, calls: Sequence[Call], config: SMCConfig, on_call: Callable[[dict], None] | None = None):
    """Run every call in order; one record each (time per token as the caller sees it, memory after)."""
    records = []
    for c in calls:
        start = time.perf_counter()
        out = pair.generate(c.prompt.text, method=c.method, config=config)
        seconds = time.perf_counter() - start
        tokens = max(1, len(out.token_ids))
        record = {
            "kind": "call",
            "call": c.index,
            "block": c.block,
            "method": c.method,
            "previous": c.previous,
            "prompt_id": c.prompt.id,
            "seconds": seconds,
            "tokens": len(out.token_ids),
            "ms_per_token": 1000 * seconds / tokens,
            "rss_mb": resident_mb(),
        }
        records.append(record)
        if on_call is not None:
            on_call(record)
    return records


def after_matrix(records: Sequence[dict], methods: Sequence[str]) -> dict[str, dict[str, float]]:
    """For each method m and predecessor p: the median over blocks of time(m after p) / time(m after m).

    Both calls of a block ran its one prompt.
    """
    by = {(r["block"], r["method"], r["previous"]): r["ms_per_token"] for r in records}
    blocks = sorted({r["block"] for r in records})
    out: dict[str, dict[str, float]] = {}
    for m in methods:
        out[m] = {}
        for p in methods:
            ratios = [by[(b, m, p)] / by[(b, m, m)] for b in blocks if (b, m, p) in by and (b, m, m) in by]
            out[m][p] = statistics.median(ratios) if ratios else float("nan")
    return out


def drift(records: Sequence[dict], methods: Sequence[str], n: int = 20) -> dict[str, float]:
    """Per method: the median time per token of its last ``n`` calls over that of its first ``n``."""
    out = {}
    for m in methods:
        times = [r["ms_per_token"] for r in records if r["method"] == m]
        k = min(n, len(times) // 2)
        out[m] = statistics.median(times[-k:]) / statistics.median(times[:k]) if k else float("nan")
    return out


def summarize(records: Sequence[dict], methods: Sequence[str]) -> dict:
    """The run's verdicts: the after-matrix, the drift, the median times and the memory trend."""
    rss = [r["rss_mb"] for r in records]
    tenth = max(1, len(rss) // 10)
    return {
        "kind": "summary",
        "calls": len(records),
        "median_ms_per_token": {
            m: statistics.median(r["ms_per_token"] for r in records if r["method"] == m) for m in methods
        },
        "after": after_matrix(records, methods),
        "last_over_first": drift(records, methods),
        "rss_first_mb": statistics.median(rss[:tenth]),
        "rss_last_mb": statistics.median(rss[-tenth:]),
        "rss_max_mb": max(rss),
    }


def summary_table(summary: dict, methods: Sequence[str]) -> str:
    """Markdown: each method's time per token after each predecessor (x its time after itself), and drift."""
    head = "| method | ms/token | " + " | ".join(f"after {p}" for p in methods) + " | last 20 / first 20 |"
    lines = [head, "|" + "---|" * (len(methods) + 3)]
    for m in methods:
        cells = [f"{summary['after'][m][p]:.2f}x" for p in methods]
        ms = summary["median_ms_per_token"][m]
        lines.append(
            f"| {m} | {ms:.1f} | " + " | ".join(cells) + f" | {summary['last_over_first'][m]:.2f}x |"
        )
    lines.append(
        f"\nResident memory: {summary['rss_first_mb']:.0f} MB over the first tenth of the calls, "
        f"{summary['rss_last_mb']:.0f} MB over the last, {summary['rss_max_mb']:.0f} MB at most."
    )
    return "\n".join(lines) + "\n"


def plot(records: Sequence[dict], methods: Sequence[str], path) -> None:
    """Time per token of every call by its place in the run, one series a method; memory below."""
    from ..plots import matplotlib_or_say

    matplotlib = matplotlib_or_say()

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(3, 1))
    for m in methods:
        mine = [r for r in records if r["method"] == m]
        speed.plot([r["call"] for r in mine], [r["ms_per_token"] for r in mine], "o-", ms=3, lw=0.8, label=m)
    speed.set(ylabel="ms per token", title="Methods interleaved call by call in one process")
    speed.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    memory.plot([r["call"] for r in records], [r["rss_mb"] for r in records], color="gray")
    memory.set(xlabel="call", ylabel="resident MB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

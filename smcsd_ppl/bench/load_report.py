"""The load test's files: JSONL records, a markdown table, and a plot against concurrency."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..plots import STYLE, finish_plot


def load_table(summaries: Sequence[dict], ceiling: dict | None) -> str:
    """One row per concurrency level: throughput (and against level 1 and the ceiling), latency, TTFT."""
    sequential = next(s["tokens_per_second"] for s in summaries if s["clients"] == 1)
    top = ceiling["tokens_per_second"] if ceiling else None
    lines = [
        "| clients | requests | errors | tokens/s | x sequential | x one batch | p50 latency (s) "
        "| p95 latency (s) | p50 TTFT (s) | same text as sequential |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        speed = s["tokens_per_second"]
        lines.append(
            f"| {s['clients']} | {s['requests']} | {s['errors']} | {speed:.1f} | {speed / sequential:.2f}x "
            f"| {_ratio(speed, top)} | {_f(s['latency_p50'])} | {_f(s['latency_p95'])} | {_f(s['ttft_p50'])} "
            f"| {_percent(s['same_as_sequential'])} |"
        )
    if ceiling:
        lines.append(
            f"| one batch | {ceiling['requests']} | 0 | {top:.1f} | {top / sequential:.2f}x | 1.00x "
            "| - | - | - | - |"
        )
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ratio(x: float, of: float | None) -> str:
    return "-" if not of else f"{x / of:.2f}x"


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def draw_load(summaries: Sequence[dict], ceiling: dict | None, path: Path) -> None:
    """Throughput (with the ceiling) and latency (p50, p95, TTFT) against concurrent clients."""
    from ..plots import matplotlib_or_say

    matplotlib = matplotlib_or_say()
    from matplotlib.figure import Figure

    clients = [s["clients"] for s in summaries]
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(10, 4.2), layout="constrained")
        speed, latency = fig.subplots(1, 2)
        speeds = [s["tokens_per_second"] for s in summaries]
        speed.plot(clients, speeds, "o-", label="smcsd serve")
        if ceiling:
            speed.axhline(
                ceiling["tokens_per_second"], ls="--", color="gray", label="the same requests as one batch"
            )
        top = max(speeds + ([ceiling["tokens_per_second"]] if ceiling else []))
        speed.set(xlabel="concurrent clients", ylabel="tokens/s", ylim=(0, top * 1.15), xscale="log")
        speed.legend(frameon=False)
        for key, label in (
            ("latency_p50", "p50 latency"),
            ("latency_p95", "p95 latency"),
            ("ttft_p50", "p50 TTFT"),
        ):
            points = [(c, s[key]) for c, s in zip(clients, summaries) if s[key] is not None]
            if points:
                latency.plot(*zip(*points), "o-", label=label)
        latency.set_xscale("log")
        for ax in (speed, latency):
            ax.set_xticks(clients, [str(c) for c in clients])
            ax.minorticks_off()
        worst = max(s["latency_p95"] or 0 for s in summaries)
        finish_plot(fig, latency, path, xlabel="concurrent clients", ylabel="seconds", ylim=(0, worst * 1.15))


def write_load_report(
    out_dir: str | Path, records: list[dict], summaries: list[dict], ceiling: dict | None, settings: dict
) -> tuple[Path, Path, Path]:
    """``load.jsonl`` (settings, every request, every level, the ceiling), ``load.md`` and ``load.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jsonl, md, png = out / "load.jsonl", out / "load.md", out / "load.png"
    rows = [{"kind": "settings"} | settings, *({"kind": "request"} | r for r in records), *summaries]
    rows += [ceiling] if ceiling else []
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    md.write_text(load_table(summaries, ceiling), encoding="utf-8")
    draw_load(summaries, ceiling, png)
    return jsonl, md, png

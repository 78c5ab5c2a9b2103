"""Speed where answers reuse their prompts: per category, SMC-SD against AR, SD and retrieval peers.

Spec-Bench's summarization, RAG and translation prompts (read from the user's copy of its
``question.jsonl``) and our editing prompts (``bench.editing``); as controls, where nothing
can be retrieved, short-answer questions and Spec-Bench's MT-bench prompts. Every method runs
on every prompt in turn, repeat after repeat (interleaved, so machine noise spreads evenly),
each run emitting exactly ``max_new_tokens`` tokens. Reported per method and category (and
over all copying prompts): median tokens/s, its ratio to AR's on the same prompts, median
tokens per target call, and the target's mean log p per output token with its standard error
(scored after each timed run, at temperature 1).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..batch.prompts import Prompt, load_prompts
from ..config import SMCConfig
from .editing import editing_prompts
from .quality import target_loglik_per_token
from .speed import learn_draft

COPY_CATEGORIES = ("summarization", "rag", "translation")
CONTROL_CATEGORIES = ("short_answer", "mt_bench")  # where retrieval finds little
COPYING = "copying, all"  # the pooled row of the copying categories and the edits
COPY_METHODS = ("ar", "sd", "racer_sampling", "hf_prompt_lookup", "smcsd")


def copy_prompts(spec_bench: str | Path, per_category: int, editing: int, controls: int = 0) -> list[Prompt]:
    """Each copying category's first ``per_category`` prompts, ``editing`` of ours, then controls.

    ``controls``: that many short-answer and that many MT-bench prompts.
    """
    if editing < 0 or editing > len(editing_prompts()):
        raise ValueError(f"editing must be between 0 and {len(editing_prompts())}, got {editing}")
    wanted = COPY_CATEGORIES + (("mt_bench",) if controls else ())
    spec = [p for p in load_prompts(spec_bench) if p.category in wanted]
    missing = set(wanted) - {p.category for p in spec}
    if missing:
        raise ValueError(
            f"{spec_bench} has no prompts of {sorted(missing)}: is it Spec-Bench's question.jsonl?"
        )
    chosen = [p for c in COPY_CATEGORIES for p in [q for q in spec if q.category == c][:per_category]]
    chosen += editing_prompts()[:editing]
    if controls:
        # The task's own categories (capitals, arithmetic, ...) are one control here.
        chosen += [
            dataclasses.replace(p, category="short_answer") for p in load_prompts("short_answer")[:controls]
        ]
        chosen += [p for p in spec if p.category == "mt_bench"][:controls]
    return chosen


@dataclass(frozen=True)
class CategoryRow:
    """Medians over one category's prompts x repeats of one method."""

    method: str
    category: str
    tokens_per_second: float
    speedup_vs_ar: float
    tokens_per_target_call: float
    target_logp_per_token: float
    runs: int
    logp_stderr: float = float("nan")


def compare_by_category(
    pair,
    prompts: Sequence[Prompt],
    config: SMCConfig,
    *,
    repeats: int = 3,
    methods: Sequence[str] = COPY_METHODS,
    on_run: Callable[[dict], None] | None = None,
) -> list[CategoryRow]:
    """Run every method on every prompt ``repeats`` times, interleaved; medians per category.

    A pair without a draft record learns one on the first prompt first (``speed.learn_draft``),
    and each method runs once untimed, so no timed run pays for lazy set-up.
    ``on_run`` gets each run's record (method, category, prompt, repeat and its figures).
    """
    config = dataclasses.replace(config, ignore_eos=True)
    warm = dataclasses.replace(config, max_new_tokens=8)
    learn_draft(pair, prompts[0].text, warm)
    for method in methods:
        pair.generate(prompts[0].text, method=method, config=warm)
    records = []
    encoded = [pair.encode(p.text) for p in prompts]
    for rep in range(repeats):
        for prompt, ids in zip(prompts, encoded):
            for method in methods:
                cfg = dataclasses.replace(config, seed=config.seed + rep)
                (out,) = pair.generate_ids([ids], method=method, config=cfg)
                records.append(
                    dict(
                        method=method,
                        category=prompt.category,
                        prompt=prompt.id,
                        repeat=rep,
                        tokens_per_second=out.stats.tokens_per_second,
                        tokens_per_target_call=out.stats.tokens_per_target_call,
                        target_logp_per_token=target_loglik_per_token(pair, ids, out.token_ids),
                    )
                )
                if on_run is not None:
                    on_run(records[-1])
    return summarized(records)


def summarized(records: Sequence[dict]) -> list[CategoryRow]:
    """Per method and category (and over all copying prompts), the medians of a run's records."""
    runs: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for r in records:
        sample = (r["tokens_per_second"], r["tokens_per_target_call"], r["target_logp_per_token"])
        runs.setdefault((r["method"], r["category"]), []).append(sample)
        if r["category"] not in CONTROL_CATEGORIES:
            runs.setdefault((r["method"], COPYING), []).append(sample)
    rows = []
    for (method, category), samples in runs.items():
        tps = statistics.median(s[0] for s in samples)
        ar = runs.get(("ar", category))
        base = statistics.median(s[0] for s in ar) if ar else float("nan")
        rows.append(
            CategoryRow(
                method,
                category,
                tps,
                tps / base,
                statistics.median(s[1] for s in samples),
                statistics.mean(s[2] for s in samples),
                len(samples),
                statistics.stdev(s[2] for s in samples) / len(samples) ** 0.5 if len(samples) > 1 else 0.0,
            )
        )
    return sorted(rows, key=lambda r: (r.category == COPYING, r.category, r.method))


EXACT_PEERS = ("sd", "racer_sampling", "hf_prompt_lookup")


def verdicts(rows: Sequence[CategoryRow], method: str = "smcsd") -> list[str]:
    """Per category, ``method`` against the fastest exact peer there (and AR, SD): lines to read."""
    lines = []
    for category in dict.fromkeys(r.category for r in rows):
        mine = {r.method: r for r in rows if r.category == category}
        if method not in mine:
            continue
        peers = [mine[m] for m in EXACT_PEERS if m in mine]
        best = max(peers, key=lambda r: r.tokens_per_second, default=None)
        line = f"{category}: {method} {mine[method].speedup_vs_ar:.2f}x AR"
        if best is not None:
            line += f", {mine[method].tokens_per_second / best.tokens_per_second:.2f}x the fastest exact peer"
            line += f" ({best.method})"
        plain = [mine[m] for m in ("ar", "sd") if m in mine]
        if plain:
            line += f", {mine[method].tokens_per_second / max(r.tokens_per_second for r in plain):.2f}x"
            line += " the faster of AR and SD"
        lines.append(line)
    return lines


def markdown_table(rows: Sequence[CategoryRow]) -> str:
    """One line per method and category."""
    lines = [
        "| category | method | tokens/s | x AR | tokens/target call | target log p/token (± s.e.) | runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.category} | {r.method} | {r.tokens_per_second:.1f} | {r.speedup_vs_ar:.2f}x | "
            f"{r.tokens_per_target_call:.2f} | {r.target_logp_per_token:.3f} ± {r.logp_stderr:.3f} | "
            f"{r.runs} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[CategoryRow], path: str | Path) -> Path:
    """Speed (x AR) against tokens per target call: one point per method and category."""
    from ..plots import matplotlib_or_say

    matplotlib_or_say().use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.6, 4.4))
    rows = [r for r in rows if r.category != COPYING]  # a point per category, not the pool
    markers = dict(zip(sorted({r.category for r in rows}), "osD^vP*X"))
    for i, method in enumerate(sorted({r.method for r in rows})):
        mine = [r for r in rows if r.method == method]
        for r in mine:
            ax.scatter(r.tokens_per_target_call, r.speedup_vs_ar, color=f"C{i}", marker=markers[r.category])
        ax.scatter([], [], color=f"C{i}", marker="o", label=method)  # the method's colour
    for category, marker in markers.items():
        ax.scatter([], [], color="grey", marker=marker, label=category)  # the category's shape
    top = max((r.speedup_vs_ar for r in rows if r.speedup_vs_ar == r.speedup_vs_ar), default=1.0)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("tokens per target call")
    ax.set_ylabel("tokens/s, x autoregressive (same category)")
    ax.set_ylim(0, 1.15 * top)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return Path(path)

"""Turn benchmark records into a markdown table and plots."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..plots import STYLE, matplotlib_or_say
from .harness import read_records

Setting = tuple  # (method, N or None, K or None, temperature)


@dataclass
class Row:
    """One setting's medians (over repeats, then over prompts)."""

    method: str
    n_particles: int | None
    block_size: int | None
    temperature: float
    prompts: int
    records: int
    errors: int
    new_tokens: float | None = None
    tokens_per_second: float | None = None
    speedup_vs_ar: float | None = None
    speedup_vs_sd: float | None = None
    ttft_seconds: float | None = None
    tokens_per_target_call: float | None = None
    acceptance: float | None = None
    mean_ess: float | None = None
    resample_rate: float | None = None
    loglik_per_token: float | None = None
    accuracy: float | None = None
    fraction_of_ceiling: float | None = None
    peak_rss_mb: float | None = None
    ess_traces: list[list[float]] = field(default_factory=list, repr=False)

    @property
    def setting(self) -> Setting:
        """(method, N, K, temperature)."""
        return (self.method, self.n_particles, self.block_size, self.temperature)

    def label(self, with_t: bool = False, drop: str = "") -> str:
        """Short name for tables and legends, e.g. ``smcsd N=8 K=8`` (without the ``drop`` field)."""
        parts = [self.method]
        parts += [f"N={self.n_particles}"] if self.n_particles is not None and drop != "n_particles" else []
        parts += [f"K={self.block_size}"] if self.block_size is not None and drop != "block_size" else []
        return " ".join(parts + ([f"T={self.temperature:g}"] if with_t else []))


@dataclass
class Report:
    """What ``write_report`` produced."""

    rows: list[Row]
    table: str
    markdown: Path
    plots: list[Path]


def load_records(path: str | Path) -> list[dict]:
    """Records of a benchmark JSONL file (a last line cut short by a kill is ignored)."""
    if not Path(path).is_file():
        raise ValueError(f"no such benchmark file: {str(path)!r}")
    return read_records(path)[0]


def summarize(records: Sequence[dict]) -> list[Row]:
    """Medians per setting; speed-ups vs ``ar`` and ``sd`` at the same temperature."""
    groups: dict[Setting, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["method"], r["n_particles"], r["block_size"], r["temperature"])].append(r)
    rows = [_row(s, rs) for s, rs in groups.items()]
    for row in rows:
        same_t = [r for r in rows if r.temperature == row.temperature and r.tokens_per_second]
        ar = [r.tokens_per_second for r in same_t if r.method == "ar"]
        sd = [r for r in same_t if r.method == "sd"]
        # vs SD with the same K; a setting without K is compared with the fastest SD
        sd_k = [r.tokens_per_second for r in sd if r.block_size == row.block_size]
        sd_ref = sd_k or ([max(r.tokens_per_second for r in sd)] if sd and row.block_size is None else [])
        if row.tokens_per_second is not None:
            row.speedup_vs_ar = row.tokens_per_second / ar[0] if ar else None
            row.speedup_vs_sd = row.tokens_per_second / sd_ref[0] if sd_ref else None
    return sorted(rows, key=lambda r: (r.temperature, r.method, r.n_particles or 0, r.block_size or 0))


def _row(setting: Setting, records: list[dict]) -> Row:
    ok = [r for r in records if not r.get("error")]
    row = Row(
        *setting,
        prompts=len({r["prompt_id"] for r in ok}),
        records=len(records),
        errors=len(records) - len(ok),
    )
    if not ok:
        return row

    def med(get: Callable[[dict], float | None]) -> float | None:
        """Median over prompts of the median over repeats, skipping missing values."""
        by_prompt: dict[str, list[float]] = defaultdict(list)
        for r in ok:
            v = get(r)
            if v is not None and v == v:
                by_prompt[r["prompt_id"]].append(v)
        per_prompt = [statistics.median(vs) for vs in by_prompt.values()]
        return statistics.median(per_prompt) if per_prompt else None

    row.new_tokens = med(lambda r: r["new_tokens"])
    row.tokens_per_second = med(lambda r: r["tokens_per_second"])
    row.ttft_seconds = med(lambda r: r["ttft_seconds"])
    row.tokens_per_target_call = med(lambda r: r["tokens_per_target_call"])
    row.acceptance = med(lambda r: r["acceptance"])
    row.mean_ess = med(lambda r: r["mean_ess"])
    row.resample_rate = med(_resample_rate)
    row.loglik_per_token = med(lambda r: r["target_loglik_per_token"])
    row.fraction_of_ceiling = med(
        lambda r: (r["target_seconds"] + r["draft_seconds"]) / r["seconds"] if r["seconds"] else None
    )
    checked = [r["correct"] for r in ok if r.get("correct") is not None]
    row.accuracy = sum(checked) / len(checked) if checked else None
    row.peak_rss_mb = max(r["peak_rss_mb"] for r in ok)
    row.ess_traces = [r["ess_trace"] for r in ok if r.get("ess_trace")]
    return row


def _resample_rate(r: dict) -> float | None:
    """Resamples per cycle; a cycle is one target call after the prefill when no trace is kept."""
    if r.get("n_resamples") is None:
        return None
    cycles = len(r["ess_trace"]) if r.get("ess_trace") else r["target_calls"] - 1
    return r["n_resamples"] / max(1, cycles)


COLUMNS = (
    ("setting", lambda r, t: r.label(t)),
    ("prompts", lambda r, t: f"{r.prompts}" + (f" ({r.errors} failed)" if r.errors else "")),
    ("tokens", lambda r, t: _f(r.new_tokens, "{:.0f}")),
    ("tok/s", lambda r, t: _f(r.tokens_per_second, "{:.1f}")),
    ("x AR", lambda r, t: _f(r.speedup_vs_ar, "{:.2f}x")),
    ("x SD", lambda r, t: _f(r.speedup_vs_sd, "{:.2f}x")),
    ("TTFT s", lambda r, t: _f(r.ttft_seconds, "{:.2f}")),
    ("tok/target call", lambda r, t: _f(r.tokens_per_target_call, "{:.2f}")),
    ("accept", lambda r, t: _f(r.acceptance, "{:.3f}")),
    (
        "ESS/N",
        lambda r, t: _f(
            r.mean_ess / r.n_particles if r.mean_ess is not None and r.n_particles else None, "{:.2f}"
        ),
    ),
    ("resample/cycle", lambda r, t: _f(r.resample_rate, "{:.2f}")),
    ("log p/token", lambda r, t: _f(r.loglik_per_token, "{:.3f}")),
    ("accuracy", lambda r, t: _f(r.accuracy, "{:.0%}")),
    ("of ceiling", lambda r, t: _f(r.fraction_of_ceiling, "{:.0%}")),
    ("peak RSS MB", lambda r, t: _f(r.peak_rss_mb, "{:.0f}")),
)

NOTES = """\
Medians over repeats, then over prompts. x AR / x SD: median tokens/s divided by that of `ar` /
of `sd` with the same K (the fastest `sd` for settings without K), same temperature, same run.
TTFT: time until the first token is reported. ESS/N: mean ESS per cycle over N; resample/cycle:
resampling rounds per cycle (SMC family). log p/token: the target's temperature-1 log-likelihood of
the output per token (higher = closer to what the target itself would write). accuracy: share of
checkable outputs that are right. of ceiling: tokens/s over the ceiling set by the measured raw
model forwards, new_tokens / (target + draft forward seconds), i.e. the share of wall time spent in
forwards; the rest is sampling, weighting, resampling and Python overhead. peak RSS: the process's
high-water mark (all settings run before it included)."""


def markdown_table(rows: Sequence[Row]) -> str:
    """The summary as a markdown table (a temperature column only when several were run)."""
    with_t = len({r.temperature for r in rows}) > 1
    lines = ["| " + " | ".join(c for c, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r, with_t) for _, fmt in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None or value != value else fmt.format(value)


def write_report(records_path: str | Path, out_dir: str | Path) -> Report:
    """Write ``report.md`` and PNG plots for a benchmark file into ``out_dir``."""
    records = load_records(records_path)
    if not records:
        raise ValueError(f"{records_path} holds no records")
    rows = summarize(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = draw_plots(rows, out)
    table = markdown_table(rows)
    first = records[0]
    cats = sorted({r["category"] for r in records})
    head = (
        f"# Benchmark: {Path(records_path).name}\n\n"
        f"target `{first['target']}`, draft `{first['draft']}`, {first.get('dtype', '?')} on "
        f"{first.get('device', '?')} ({first.get('threads', '?')} CPU thread(s)), "
        f"max_new_tokens {first['max_new_tokens']}; "
        f"{len({r['prompt_id'] for r in records})} prompts ({', '.join(cats)}), "
        f"{1 + max(r['repeat'] for r in records)} repeat(s), {len(records)} records.\n\n"
    )
    images = "".join(f"![{p.stem}]({p.name})\n" for p in plots)
    md = head + table + "\n\n" + NOTES + "\n\n" + images
    path = out / "report.md"
    path.write_text(md, encoding="utf-8")
    return Report(rows, table, path, plots)


def draw_plots(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    """Write the PNGs that have data (speed-up vs N and K, quality vs speed-up, ESS); their paths."""
    matplotlib = matplotlib_or_say()
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    plots = {
        "speedup_vs_n": lambda ax: _speedup_vs(ax, rows, "n_particles", "number of particles N"),
        "speedup_vs_k": lambda ax: _speedup_vs(
            ax, rows, "block_size", "block size K (tokens drafted per cycle)"
        ),
        "quality_vs_speedup": lambda ax: _quality(
            ax, rows, "loglik_per_token", "target log-likelihood per token"
        ),
        "accuracy_vs_speedup": lambda ax: _quality(ax, rows, "accuracy", "task accuracy"),
        "ess_over_generation": lambda ax: _ess(ax, rows),
    }
    paths = []
    with matplotlib.rc_context(STYLE):
        for name, draw in plots.items():
            fig = Figure(figsize=(7.5, 4.8), layout="constrained")
            ax = fig.add_subplot()
            if draw(ax):
                ax.legend(loc="best", frameon=False)
                paths.append(out_dir / f"{name}.png")
                fig.savefig(paths[-1], dpi=130)
    return paths


def _speed(rows: Sequence[Row]) -> tuple[Callable[[Row], float | None], str]:
    """Speed-up vs AR when the run has AR, else raw tokens/s."""
    if any(r.speedup_vs_ar is not None for r in rows):
        return (lambda r: r.speedup_vs_ar), "speed-up over autoregressive (x)"
    return (lambda r: r.tokens_per_second), "tokens / s"


def _speedup_vs(ax, rows: Sequence[Row], x_attr: str, xlabel: str) -> bool:
    y, ylabel = _speed(rows)
    with_t = len({r.temperature for r in rows}) > 1
    pts = [r for r in rows if getattr(r, x_attr) is not None and y(r) is not None]
    if not pts:
        return False
    lines: dict[str, list[Row]] = defaultdict(list)
    for r in sorted(pts, key=lambda r: getattr(r, x_attr)):  # one line per setting of all but x
        lines[r.label(with_t, drop=x_attr)].append(r)
    for label, rs in lines.items():
        ax.plot([getattr(r, x_attr) for r in rs], [y(r) for r in rs], marker="o", lw=2, label=label)
    refs = [r for r in rows if getattr(r, x_attr) is None and r.method != "ar" and y(r) is not None]
    for i, r in enumerate(refs):  # settings without this axis (SD in the N plot) as flat references
        ax.axhline(y(r), ls=":", lw=1.8, color=f"C{len(lines) + i}", label=f"{r.label(with_t)} (reference)")
    if "speed-up" in ylabel:
        ax.axhline(1.0, ls="--", lw=1, color="0.5", label="autoregressive")
    ax.set_xticks(sorted({getattr(r, x_attr) for r in pts}))
    ax.set(xlabel=xlabel, ylabel=ylabel, title=f"Speed-up vs {xlabel.split(' (')[0]}")
    ax.set_ylim(bottom=0)
    return True


def _quality(ax, rows: Sequence[Row], attr: str, ylabel: str) -> bool:
    x, xlabel = _speed(rows)
    pts = [r for r in rows if x(r) is not None and getattr(r, attr) is not None]
    if not pts:
        return False
    q = lambda r: getattr(r, attr)  # noqa: E731
    front, best = [], float("-inf")
    for r in sorted(pts, key=lambda r: (-x(r), -q(r))):  # fastest first
        if q(r) > best:  # on the front: nothing faster is as good
            front.append(r)
            best = q(r)
    ax.scatter([x(r) for r in pts], [q(r) for r in pts], s=40, color="tab:blue", label="settings")
    front.sort(key=x)
    ax.plot([x(r) for r in front], [q(r) for r in front], "-o", color="tab:red", lw=2, ms=10, mfc="none",
            mew=2, label="Pareto front")  # fmt: skip
    with_t = len({r.temperature for r in rows}) > 1
    for i, r in enumerate(sorted(pts, key=x)):  # alternate sides so neighbours' labels do not collide
        right = i % 2 == 0
        ax.annotate(r.label(with_t), (x(r), q(r)), textcoords="offset points", fontsize=8,
                    xytext=(6, 5) if right else (-6, -13), ha="left" if right else "right")  # fmt: skip
    title = f"{ylabel[0].upper()}{ylabel[1:]} vs speed (up and right is better)"
    ax.set(xlabel=xlabel, ylabel=f"{ylabel} (higher is better)", title=title)
    if attr == "accuracy":
        from matplotlib.ticker import PercentFormatter

        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.margins(x=0.2, y=0.15)
    return True


def _ess(ax, rows: Sequence[Row]) -> bool:
    rows = [r for r in rows if r.ess_traces and r.n_particles]
    with_t = len({r.temperature for r in rows}) > 1
    for r in rows:
        cycles = range(max(len(t) for t in r.ess_traces))
        cols = [[t[c] / r.n_particles for t in r.ess_traces if c < len(t)] for c in cycles]
        qs = [statistics.quantiles(c, n=4, method="inclusive") if len(c) > 1 else c * 3 for c in cols]
        xs = [c + 1 for c in cycles]
        line = ax.plot(xs, [q[1] for q in qs], lw=2, label=r.label(with_t))[0]
        ax.fill_between(xs, [q[0] for q in qs], [q[2] for q in qs], color=line.get_color(), alpha=0.15)
    ax.set(xlabel="cycle", ylabel="ESS / N (before resampling)", ylim=(0, 1.05),
           title="ESS over generation (median and interquartile band over prompts)")  # fmt: skip
    return bool(rows)

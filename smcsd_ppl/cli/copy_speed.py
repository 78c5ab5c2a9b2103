"""``smcsd copy-speed``: speed per category where answers reuse their prompts (retrieval's ground)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .loading import load_pair
from .options import command, smc_args, smc_config
from .util import csv, err, progress


def add_parser(sub) -> None:
    """Add the ``copy-speed`` subcommand to the ``smcsd`` parser."""
    p = command(
        sub,
        "copy-speed",
        "tokens/s and tokens per target call per category: Spec-Bench summarization, RAG, translation "
        "and our editing prompts, SMC-SD against AR, SD and retrieval peers",
    )
    smc_args(p)
    p.set_defaults(max_new_tokens=96)
    p.add_argument("--spec-bench", help="Spec-Bench's question.jsonl (read, never copied)")
    p.add_argument(
        "--report", metavar="JSONL", help="no runs: the table and plot of an earlier run's copy_speed.jsonl"
    )
    p.add_argument("--per-category", type=int, default=7, help="Spec-Bench prompts per category")
    p.add_argument("--editing", type=int, default=20, help="how many of our editing prompts (at most 22)")
    p.add_argument(
        "--controls",
        type=int,
        default=0,
        help="also this many short-answer and this many MT-bench prompts, where little can be retrieved",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per prompt and method (medians reported)")
    p.add_argument(
        "--methods", default="ar,sd,racer_sampling,hf_prompt_lookup,smcsd", help="comma-separated methods"
    )
    p.add_argument(
        "--out",
        required=True,
        help="folder for the runs (copy_speed.jsonl), the table (copy_speed.md), the plot",
    )
    p.set_defaults(run=_copy_speed)


def _copy_speed(args: argparse.Namespace) -> int:
    from ..bench.copying import markdown_table, plot, summarized, verdicts

    out = Path(args.out)
    if args.report:
        records = [json.loads(line) for line in Path(args.report).read_text(encoding="utf-8").splitlines()]
        rows, header = summarized(records), f"{len(records)} runs of {args.report}"
    elif not args.spec_bench:
        raise ValueError("--spec-bench is required (Spec-Bench's question.jsonl), unless --report is given")
    else:
        rows, header = _run(args, out)
    table = (
        header
        + "\n\n"
        + markdown_table(rows)
        + "\n\n"
        + "\n".join(f"- {line}" for line in verdicts(rows))
        + "\n"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "copy_speed.md").write_text(table, encoding="utf-8")
    path = plot(rows, out / "copy_speed.png")
    print(table)
    print(f"plot: {path}")
    return 0


def _run(args: argparse.Namespace, out: Path) -> tuple[list, str]:
    """Every method on every prompt, interleaved; each run's record to copy_speed.jsonl as it ends."""
    from ..bench.copying import compare_by_category, copy_prompts
    from ..methods import METHODS

    config = smc_config(args)
    methods = csv(args.methods, str, "--methods")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "ar" not in methods:
        raise ValueError(f"--methods must name registered methods, ar among them; unknown: {unknown}")
    for flag, value in (("--repeats", args.repeats), ("--per-category", args.per_category)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.controls < 0:
        raise ValueError(f"--controls must be >= 0, got {args.controls}")
    prompts = copy_prompts(args.spec_bench, args.per_category, args.editing, args.controls)
    out.mkdir(parents=True, exist_ok=True)
    pair = load_pair(args)
    total = args.repeats * len(prompts) * len(methods)
    err(f"{len(prompts)} prompts x {len(methods)} methods x {args.repeats} repeats = {total} runs")
    with progress(total, "runs") as bar, open(out / "copy_speed.jsonl", "w", encoding="utf-8") as log:
        done = [0]

        def tick(record: dict) -> None:
            log.write(json.dumps(record) + "\n")
            log.flush()
            done[0] += 1
            bar(done[0])

        rows = compare_by_category(pair, prompts, config, repeats=args.repeats, methods=methods, on_run=tick)
    header = (
        f"{config.max_new_tokens} tokens per run (EOS ignored), "
        f"N={config.n_particles}, K={config.block_size}, "
        f"proposal={config.proposal}, cut={config.cut}, T_d={config.draft_temperature}, "
        f"T_t={config.target_temperature}, {args.dtype} on {args.device}; medians of {args.repeats} repeats "
        f"x {len(prompts)} prompts, interleaved"
    )
    return rows, header

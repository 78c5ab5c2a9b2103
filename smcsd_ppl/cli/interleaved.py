"""``smcsd interleaved``: methods interleaved call by call in one process; does a call depend on the last?"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..names import INTERLEAVED_METHODS
from .loading import load_pair
from .options import command, smc_args, smc_config
from .util import check_output_dir, csv, err, progress


def add_parser(sub) -> None:
    """Add the ``interleaved`` subcommand to the ``smcsd`` parser."""
    p = command(
        sub,
        "interleaved",
        "every method interleaved call by call in one process, as users run them: does a call's time "
        "depend on what ran before it, or on how many ran? (JSONL, markdown, plot)",
    )
    smc_args(p)
    p.set_defaults(max_new_tokens=96)
    p.add_argument(
        "--dataset",
        default="editing",
        help="prompts: 'editing' (built in, answers that copy their prompt), another dataset name, or a "
        "JSONL file (default: editing)",
    )
    p.add_argument("--prompts", type=int, default=4, help="prompts used, each for two blocks (default 4)")
    p.add_argument(
        "--blocks",
        type=int,
        default=8,
        help="blocks of calls; in each, every method runs right after every method once (default 8: "
        "208 calls with 5 methods)",
    )
    p.add_argument("--methods", default=",".join(INTERLEAVED_METHODS), help="comma-separated methods")
    p.add_argument("--out-dir", required=True, help="where to write interleaved.jsonl, .md and .png")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from ..batch.prompts import load_prompts
    from ..bench import interleaved as bench
    from ..bench.editing import editing_prompts
    from ..methods import get

    methods = csv(args.methods, str, "--methods")
    for m in methods:
        get(m)  # an unknown name fails before anything loads
    if args.prompts < 1 or args.blocks < 1:
        raise ValueError("--prompts and --blocks must be at least 1")
    check_output_dir(args.out_dir, "--out-dir")
    pool = editing_prompts() if args.dataset == "editing" else load_prompts(args.dataset)
    calls = bench.plan_calls(methods, pool[: args.prompts], args.blocks)
    config = smc_config(args)
    pair = load_pair(args)
    for m in methods:  # each method's first-call costs, before anything is timed
        pair.generate(pool[0].text, method=m, config=config)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "interleaved.jsonl").open("w", encoding="utf-8") as f, progress(len(calls), "calls") as bar:

        def written(record: dict) -> None:
            f.write(json.dumps(record) + "\n")
            f.flush()
            bar(record["call"] + 1)

        records = bench.run_calls(pair, calls, config, written)
        summary = bench.summarize(records, methods)
        f.write(json.dumps(summary) + "\n")
    table = bench.summary_table(summary, methods)
    (out / "interleaved.md").write_text(table, encoding="utf-8")
    bench.plot(records, methods, out / "interleaved.png")
    print(table, end="")
    err(f"wrote {out / 'interleaved.jsonl'}, {out / 'interleaved.md'}, {out / 'interleaved.png'}")
    return 0

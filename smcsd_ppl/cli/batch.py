"""``smcsd batch``: every prompt of a JSONL file, full outputs to a resumable JSONL file."""

from __future__ import annotations

import argparse

from ..names import METHOD_SUMMARIES
from .loading import load_pair
from .options import (
    constraint_args,
    model_args,
    prompt_args,
    read_constraint,
    smc_args,
    smc_config,
)
from .util import check_output_file, check_threads, err, progress


def add_parser(sub) -> None:
    """Add ``batch`` to the ``smcsd`` parser."""
    p = sub.add_parser(
        "batch",
        help="generate for every prompt of a JSONL file, one output record per prompt (resumable)",
        description="Each prompt runs alone, with a seed made from --seed and the prompt's id, so its "
        "record does not depend on the other prompts, their order or an interruption. Records carry "
        "the settings; rerunning the command skips the prompts already in --out.",
    )
    p.add_argument(
        "prompts",
        help="JSONL file: records with a 'prompt' (or 'text') field and an optional unique 'id' "
        "(default: the line's index); Spec-Bench and GSM8K files also work",
    )
    p.add_argument(
        "--out",
        required=True,
        help="JSONL file of records; an existing one is resumed (its prompts skipped) if made with the "
        "same settings",
    )
    prompt_args(p, per_category=None)
    p.add_argument("--method", choices=list(METHOD_SUMMARIES), default="smcsd", help="as in generate")
    model_args(p)
    smc_args(p)
    constraint_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the batch; a summary on stderr, 130 if interrupted (rerun to resume)."""
    from ..bench import load_prompts
    from ..bench.batch import run_batch

    config = smc_config(args)  # the base seed: each prompt's seed derives from it and the prompt's id
    wanted = read_constraint(args)
    prompts = load_prompts(args.prompts, limit=args.limit, per_category=args.per_category)
    check_output_file(args.out, "--out")
    check_threads(args.threads)
    pair = load_pair(args)
    err(f"{len(prompts)} prompts -> {args.out}")
    done = [0]
    try:
        with progress(len(prompts), "prompts") as bar:

            def tick(_record: dict, n: int, _total: int) -> None:
                done[0] = n
                bar(n)

            summary = run_batch(
                pair, prompts, args.out, config, method=args.method, constraint=wanted, on_record=tick
            )
    except KeyboardInterrupt:
        err(f"interrupted after {done[0]}/{len(prompts)} prompts; run the same command again to resume")
        return 130
    records = summary.records
    rate = summary.new_tokens / summary.seconds if summary.seconds else 0.0
    err(
        f"{len(records)} prompts in {args.out} ({len(records) - summary.resumed} run now, {summary.resumed} "
        f"resumed from the file): {summary.failed} failed, {summary.with_message} with a message (empty or "
        f"cut short); all records: {summary.new_tokens} tokens, {summary.seconds:.1f} s of generation, "
        f"{rate:.1f} tok/s"
    )
    failed = [r for r in records if "error" in r]
    if failed:
        err(f"first failure (prompt {failed[0]['prompt_id']}): {failed[0]['error']}")
    return 1 if len(failed) == len(records) else 0

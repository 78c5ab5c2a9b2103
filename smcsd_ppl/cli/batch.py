"""``smcsd batch``: every prompt of a JSONL file, full outputs to a resumable JSONL file."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time
import warnings

from ..names import METHOD_SUMMARIES
from .loading import load_pair, pair_options
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
        description="SMC-SD's prompts run as one batch (each joins as rows free up; its record is written "
        "as it finishes), each with a seed made from --seed and the prompt's id, so its record does not "
        "depend on the other prompts, their order or an interruption. Records carry the settings; "
        "rerunning the command skips the prompts already in --out.",
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
    p.add_argument(
        "--alone",
        action="store_true",
        help="run the prompts one after another, not as one batch (bf16 records then match a run "
        "of each prompt alone bit for bit; float32 ones match either way). On a CPU this is faster: "
        "there a batch's rows cost nearly what they cost alone (docs/benchmarks.md)",
    )
    p.add_argument("--quiet", action="store_true", help="nothing on standard error but errors")
    model_args(p)
    smc_args(p)
    constraint_args(p)
    g = p.add_argument_group("ray (docs/scaling.md)")
    g.add_argument(
        "--ray",
        action="store_true",
        help="spread the prompts over a pool of Ray actors, one pair each (RAY_ADDRESS: the cluster; "
        "unset: a local one)",
    )
    g.add_argument("--workers", type=int, default=2, help="--ray: actors, each loading its own pair")
    g.add_argument(
        "--gpus-per-worker",
        type=float,
        default=None,
        help="--ray: GPUs Ray reserves per actor (default: --tensor-parallel on cuda, else 0)",
    )
    g.add_argument(
        "--prompts-per-batch",
        type=int,
        default=16,
        help="--ray: prompts handed to an actor at a time, run there as one batch (records are "
        "written as batches come back)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the batch; a summary on stderr, 130 if interrupted (rerun to resume)."""
    from ..batch.prompts import load_prompts

    wanted = read_constraint(args)
    # the base seed: each prompt's seed derives from it and the prompt's id
    config = smc_config(args)
    prompts = load_prompts(args.prompts, limit=args.limit, per_category=args.per_category)
    check_output_file(args.out, "--out")
    check_threads(args.threads)
    if args.ray and args.alone:
        raise ValueError("--alone runs the prompts one after another in this process: leave out --ray")
    check_resumable(args.out, prompts, config, args.method, wanted)
    start = _on_ray(args) if args.ray else _in_process(args)
    err(f"{len(prompts)} prompts -> {args.out}")
    done = [0]
    try:
        with progress(len(prompts), "prompts") as bar:

            def tick(_record: dict, n: int, _total: int) -> None:
                done[0] = n
                bar(n)

            began = time.perf_counter()
            options = dict(method=args.method, constraint=wanted, on_record=tick)
            options |= {} if args.ray else {"alone": args.alone}
            summary = start(prompts, args.out, config, **options)
            wall = time.perf_counter() - began
    except KeyboardInterrupt:
        err(f"interrupted after {done[0]}/{len(prompts)} prompts; run the same command again to resume")
        return 130
    records = summary.records
    fresh = summary.fresh_tokens
    reasons = ", ".join(f"{n} {reason}" for reason, n in summary.finish_reasons.items())
    err(
        f"{len(records)} prompts in {args.out} ({len(records) - summary.resumed} run now, {summary.resumed} "
        f"resumed from the file): {summary.failed} failed, {summary.with_message} with a message; "
        f"ended by: {reasons or 'none'}; this run: {fresh} tokens in {wall:.1f} s wall = "
        f"{fresh / wall if wall else 0.0:.1f} tok/s"
        + (" (the actors' start and model loading included)" if args.ray else "")
    )
    failed = [r for r in records if "error" in r]
    if failed:
        err(f"first failure (prompt {failed[0]['prompt_id']}): {failed[0]['error']}")
    return 1 if len(failed) == len(records) else 0


def check_resumable(out: str, prompts, config, method: str, constraint) -> None:
    """Refuse, before any model loads, to resume an ``--out`` made with other settings or prompts.

    The models' own settings (their names, dtype, device) are checked once they have loaded.
    """
    from ..batch.records import check_compatible, read_records
    from ..batch.run import BATCH_KEY, WRITER, settings_before_loading

    existing, _ = read_records(out, key_fields=BATCH_KEY, writer=WRITER)
    check_compatible(existing, settings_before_loading(config, method, constraint), prompts)


def _in_process(args: argparse.Namespace):
    """``run_batch`` on a pair loaded here."""
    from ..batch.run import run_batch

    pair = load_pair(args)
    pair.core.build_forwards(background=True)  # a batch is long work: compiled parts as they come
    return functools.partial(run_batch, pair)


def _on_ray(args: argparse.Namespace):
    """``run_batch_on_ray`` over ``--workers`` actors, each loading the pair the options name."""
    from ..api import SMCSD
    from ..batch.on_ray import RAY_HINT, RayPool, run_batch_on_ray

    options = pair_options(args)
    gpus = args.gpus_per_worker
    if gpus is None:
        gpus = args.tensor_parallel if args.device.startswith("cuda") else 0
    pool = RayPool(args.workers, gpus, args.prompts_per_batch)
    try:
        import ray
        import ray.data  # configures its loggers on import: quieted below, after it
    except ImportError as e:
        raise ValueError(RAY_HINT) from e
    with warnings.catch_warnings():  # Ray's notes on its own deprecated settings: not the user's news
        warnings.simplefilter("ignore", DeprecationWarning)
        ray.data.DataContext.get_current()
    if not ray.is_initialized():  # RAY_ADDRESS names a cluster; unset, a local one starts here
        local = "RAY_ADDRESS" not in os.environ
        ray.init(
            logging_level=logging.ERROR,
            log_to_driver=False,
            **({"include_dashboard": False} if local else {}),
        )
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # its notes on every run; errors still show
    where = f"{args.workers} Ray actors ({gpus:g} GPUs each)"
    err(f"loading a pair in each of {where}: {options['target'] or 'default target'} on {args.device}")
    load = functools.partial(SMCSD.load, **options)
    return functools.partial(run_batch_on_ray, load, pool=pool)

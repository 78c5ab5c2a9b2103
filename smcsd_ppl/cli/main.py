"""The ``smcsd`` command line: the only part of the package that prints."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator

from ..config import RESAMPLING_SCHEMES, SMCConfig
from ..names import METHOD_SUMMARIES
from ..text import check_prompt
from . import (
    batch,
    compare,
    constraints,
    copy_speed,
    device,
    distill,
    eval_draft,
    fidelity,
    generate,
    interleaved,
    load,
    serve,
)
from .loading import load_pair, pair_options
from .options import (
    grid_args,
    model_args,
    prompt_args,
    smc_args,
    smc_config,
)
from .util import (
    PROG,
    QUIET,
    USER_ERRORS,
    Parser,
    check_output_dir,
    check_output_file,
    check_threads,
    csv,
    cut_value,
    err,
    progress,
    say_error,
    status,
    user_error,
)

INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it

SPEED_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Describe the water cycle to a ten-year-old.",
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``smcsd`` (also used to document the CLI)."""
    parser = Parser(prog=PROG, description="SMC speculative decoding: fast sampling with N draft particles.")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    batch.add_parser(sub)
    _add_speed(sub)
    copy_speed.add_parser(sub)
    interleaved.add_parser(sub)
    _add_bench(sub)
    _add_report(sub)
    compare.add_parser(sub)
    constraints.add_parsers(sub)
    device.add_parser(sub)
    fidelity.add_parser(sub)
    distill.add_parsers(sub)
    eval_draft.add_parser(sub)
    serve.add_parser(sub)
    load.add_parser(sub)
    return parser


def _add_speed(sub) -> None:
    speed = sub.add_parser("speed", help="tokens/s of SMC-SD vs AR, exact SD and HF generate(), side by side")
    model_args(speed)
    smc_args(speed)
    speed.add_argument("--repeats", type=int, default=3, help="runs per prompt and method (medians reported)")
    speed.add_argument("--prompt", action="append", help="prompt to time (repeatable; default: 3 built-in)")
    speed.set_defaults(run=_speed)


def _add_bench(sub) -> None:
    bench = sub.add_parser(
        "bench", help="benchmark methods x N x K x temperatures on a dataset (resumable JSONL records)"
    )
    bench.add_argument(
        "--dataset",
        required=True,
        help="JSONL file (Spec-Bench, GSM8K, or records with a 'prompt' field), "
        "or short_answer|humaneval|spec_bench|gsm8k",
    )
    prompt_args(bench, per_category=None)
    bench.add_argument(
        "--methods", default="ar,sd,smcsd", help=f"comma-separated, from: {', '.join(METHOD_SUMMARIES)}"
    )
    grid_args(bench, particles="4,8", block_sizes="4,8")
    bench.add_argument("--temperatures", default="0.7", help="comma-separated T_d = T_t values")
    bench.add_argument("--repeats", type=int, default=1, help="runs per setting and prompt")
    bench.add_argument("--max-new-tokens", type=int, default=128, help="generation budget per record")
    bench.add_argument("--ess-threshold", type=float, default=0.5, help="resample when ESS < this x N")
    bench.add_argument(
        "--resampling", choices=RESAMPLING_SCHEMES, default="systematic", help="resampling scheme"
    )
    bench.add_argument("--alpha", type=float, default=1.0, help="power on the target")
    bench.add_argument("--seed", type=int, default=0, help="base seed (each record's seed derives from it)")
    bench.add_argument("--ignore-eos", action="store_true", help="always emit --max-new-tokens tokens")
    bench.add_argument(
        "--cut", type=cut_value, default=SMCConfig.cut, help="the smcsd rows' quality cut ('off': none)"
    )
    bench.add_argument(
        "--out",
        required=True,
        help="JSONL file of records; an existing one is resumed if it was made with the same settings",
    )
    model_args(bench)
    bench.set_defaults(run=_bench)


def _add_report(sub) -> None:
    report = sub.add_parser("report", help="markdown table and plots of a bench run")
    report.add_argument("records", help="the JSONL file written by smcsd bench")
    report.add_argument(
        "--out-dir", default=None, help="where to write report.md and PNGs (default: RECORDS without .jsonl)"
    )
    report.set_defaults(run=_report)


def _speed(args: argparse.Namespace) -> int:
    from ..api import SMCSD
    from ..bench.speed import BESIDE_METHODS, SPEED_METHODS, VLLM_SPEED_METHODS, compare_speed

    config = smc_config(args)
    prompts = [check_prompt(p) for p in args.prompt or SPEED_PROMPTS]
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    forward, args.forward = args.forward, "reference"  # the reference rows are the baseline
    pair = load_pair(args)
    methods, others = SPEED_METHODS, {}
    if args.backend == "vllm":  # the HF backend's AR beside: the models built in PyTorch too, for it
        hf = SMCSD.load(**(pair_options(args) | {"backend": "hf", "vllm_options": None}))
        methods, others = VLLM_SPEED_METHODS, {"ar (HF backend)": (hf, "ar")}
    if forward != "reference" and args.backend == "hf":  # our forward's rows beside, on the same models
        with status(f"building the {forward} forward"):
            ours = SMCSD(
                pair.target,
                pair.draft,
                chat=not args.no_chat,
                forward=forward,
                deterministic=args.deterministic,
            )
        ours.draft_record = pair.draft_record
        err(ours.core.forward_note())
        others |= {f"{m} ({forward})": (ours, m) for m in BESIDE_METHODS}
    total = args.repeats * len(prompts) * (len(methods) + len(others))
    with progress(total, "runs") as bar:
        done = [0]

        def tick(_method: str) -> None:
            done[0] += 1
            bar(done[0])

        rows = compare_speed(
            pair, prompts, config, repeats=args.repeats, methods=methods, on_run=tick, others=others
        )
    print(
        f"{config.max_new_tokens} tokens per run, N={config.n_particles}, K={config.block_size}, "
        f"T_d={config.draft_temperature}, T_t={config.target_temperature}, {args.dtype} on {args.device} "
        f"({args.backend} backend); "
        f"medians of {args.repeats} repeats x {len(prompts)} prompts"
    )
    print("| method | tokens/s | x autoregressive | tokens/target call | loop overhead |")
    print("|---|---|---|---|---|")
    for r in rows:
        ovh = "-" if r.overhead_fraction != r.overhead_fraction else f"{100 * r.overhead_fraction:.0f}%"
        print(
            f"| {r.method} | {r.tokens_per_second:.1f} | {r.speedup_vs_ar:.2f}x | "
            f"{r.tokens_per_target_call:.2f} | {ovh} |"
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ..bench import Grid, load_prompts, run_bench

    base = smc_config(args)
    grid = Grid(
        csv(args.methods, str, "--methods"),
        csv(args.particles, int, "--particles"),
        csv(args.block_sizes, int, "--block-sizes"),
        csv(args.temperatures, float, "--temperatures"),
        base,
    )
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    prompts = load_prompts(args.dataset, limit=args.limit, per_category=args.per_category)
    check_output_file(args.out, "--out")
    check_threads(args.threads)
    total = len(grid.settings()) * len(prompts) * args.repeats
    pair = load_pair(args)
    err(
        f"{len(prompts)} prompts x {len(grid.settings())} settings x {args.repeats} repeats "
        f"= {total} records -> {args.out}"
    )
    saved = [0]
    try:
        with progress(total, "records") as bar:

            def tick(_record: dict, done: int, _total: int) -> None:
                saved[0] = done
                bar(done)

            records = run_bench(pair, prompts, grid, args.out, args.repeats, on_record=tick)
    except KeyboardInterrupt:
        err(f"interrupted after {saved[0]}/{total} records; run the same command again to resume")
        return 130
    failed = [r for r in records if "error" in r]
    if failed:
        err(f"first failure ({failed[0]['method']}, prompt {failed[0]['prompt_id']}): {failed[0]['error']}")
    err(f"{total} records ({len(failed)} failed) in {args.out}; summarize them with: smcsd report {args.out}")
    return 1 if len(failed) == len(records) else 0


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..bench.report import write_report
    from ..plots import matplotlib_or_say

    matplotlib_or_say()  # before reading anything: the plots need it
    out_dir = args.out_dir or str(Path(args.records).with_suffix(""))
    check_output_dir(out_dir, "--out-dir")
    rep = write_report(args.records, out_dir)
    for path in [rep.markdown, *rep.plots]:
        print(f"wrote {path}")
    print()
    print(rep.table)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``smcsd`` console script.

    The one place that turns a user's mistake (``USER_ERRORS``) into a one-line message
    and exit status 2, as argparse does for bad arguments. Ctrl-C or SIGTERM ends a command
    with exit status 130 or 143 once it has said what it kept; called from Python with
    ``argv`` (a test, a notebook), the ``KeyboardInterrupt`` then goes on to the caller,
    whose Ctrl-C it is.
    """
    args = build_parser().parse_args(argv)
    QUIET["on"] = getattr(args, "quiet", False)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with _as_process(argv is None) as signals:
        try:
            status = args.run(args)
        except USER_ERRORS as e:
            say_error(f"{PROG}: error: {user_error(e)}")
            return 2
        except KeyboardInterrupt:
            err("interrupted")
            status = INTERRUPTED
    if status == INTERRUPTED and argv is not None:
        raise KeyboardInterrupt  # swallowed here, a Ctrl-C would stop the command but not its caller
    return 128 + signals[-1] if status == INTERRUPTED and signals else status


@contextlib.contextmanager
def _as_process(process: bool) -> Iterator[list[int]]:
    """As the process's command: SIGTERM interrupts as Ctrl-C does, and the torch thread ends first.

    Yields the signals received. The interpreter must not exit while the torch thread is inside
    a kernel: that aborts the whole process, and the user sees a crash instead of exit 130.
    """
    received: list[int] = []
    if not process:
        yield received
        return

    def interrupt(signum: int, _frame) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
        worker = sys.modules.get("smcsd_ppl.engine.worker")  # not loaded: no torch thread to end
        if worker is not None:
            worker.torch_thread().stop()


if __name__ == "__main__":
    sys.exit(main())

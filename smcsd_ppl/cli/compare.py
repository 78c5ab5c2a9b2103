"""``smcsd compare-constrained``: constrained generation, every method side by side."""

from __future__ import annotations

import argparse

from .loading import load_pair
from .options import command
from .util import check_threads, csv, cut_value, progress

# The names of smcsd_ppl.methods.steering.STEERING_METHODS, kept here so that building the parser imports no
# torch; a test checks that they match.
CONSTRAINED_METHODS = (
    "smcsd_proposal",
    "smcsd_critic",
    "smcsd_filtered",
    "smcsd_plain",
    "llamppl_smc",
    "llamppl_masked",
    "genlm_awrs",
    "genlm_direct",
    "genlm_critic",
)


def add_parser(sub) -> None:
    """Add the ``compare-constrained`` subcommand to the ``smcsd`` parser."""
    cc = command(
        sub,
        "compare-constrained",
        "constrained generation: SMC-SD programs vs LLaMPPL, genlm-control and rejection, one table",
    )
    cc.add_argument("--tasks", default="date,phone,json,short_words", help="comma-separated built-in tasks")
    cc.add_argument(
        "--methods", default=None, help=f"comma-separated (default: all): {', '.join(CONSTRAINED_METHODS)}"
    )
    cc.add_argument("-n", "--particles", type=int, default=8, help="N particles, every method")
    cc.add_argument("-k", "--block-size", type=int, default=8, help="K for SMC-SD")
    cc.add_argument("--temperature", type=float, default=0.7, help="T of every model")
    cc.add_argument("--max-new-tokens", type=int, default=32, help="generation budget per run")
    cc.add_argument("--repeats", type=int, default=1, help="runs per task and method (medians reported)")
    cc.add_argument("--seed", type=int, default=0, help="seed of every run")
    cc.add_argument(
        "--cut",
        type=cut_value,
        default=None,
        help="SMC-SD's quality cut (default off: the paper's algorithm)",
    )
    cc.set_defaults(run=_compare_constrained)


def _compare_constrained(args: argparse.Namespace) -> int:
    from ..bench.constrained import METHODS as CC_METHODS
    from ..bench.constrained import TASKS, compare_constrained

    tasks = [TASKS[t] if t in TASKS else _unknown("task", t, TASKS) for t in csv(args.tasks, str, "--tasks")]
    methods = csv(args.methods, str, "--methods") if args.methods else list(CC_METHODS)
    for m in methods:
        if m not in CC_METHODS:
            _unknown("method", m, CC_METHODS)
    check_threads(args.threads)
    pair = load_pair(args)
    total = args.repeats * len(tasks) * len(methods)
    with progress(total, "runs") as bar:
        done = [0]

        def tick(task: str, method: str, _rec) -> None:
            done[0] += 1
            bar(done[0])

        rows = compare_constrained(
            pair,
            tasks,
            methods,
            n_particles=args.particles,
            block_size=args.block_size,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            repeats=args.repeats,
            cut=args.cut,
            on_run=tick,
        )
    _print_table(rows, args)
    return 0


def _print_table(rows, args: argparse.Namespace) -> None:
    """The comparison as a markdown table, then the speed ratios per task."""
    from ..bench.constrained import speed_ratios

    print(
        f"N={args.particles}, K={args.block_size} (SMC-SD), T={args.temperature} for every model, "
        f"max {args.max_new_tokens} new tokens, {args.dtype} on {args.device}; medians of {args.repeats} "
        "repeat(s). valid = share of final particles (positive weight, constraint met); output = share "
        "of returned texts; tokens = mean per particle, EOS included (smcsd_plain: length-matched to "
        "smcsd_proposal); log p/tok = untempered target on the returned tokens; ESS at the end; "
        "target fwd = target forward calls per run, prefill included."
    )
    cols = ("task", "method", "valid", "output valid", "tokens/s", "tokens", "s")
    cols += ("log p/tok", "log Z", "ESS", "target fwd")
    print("| " + " | ".join(cols) + " | output |")
    print("|---" * (len(cols) + 1) + "|")
    for r in rows:
        text = r.example.replace("|", "\\|").replace("\n", " ")[:40]
        print(
            f"| {r.task} | {r.method} | {r.validity:.2f} | {r.output_validity:.2f} | "
            f"{r.tokens_per_second:.2f} | {r.tokens:.1f} | {r.seconds:.1f} | {r.loglik_per_token:.2f} | "
            f"{r.log_z:.2f} | {r.ess:.2f} | {r.target_forwards:.0f} | {text} |"
        )
    for task, ratios in speed_ratios(rows).items():
        print(f"{task}: smcsd_proposal tokens/s = " + ", ".join(f"{v:.2f}x {m}" for m, v in ratios.items()))


def _unknown(kind: str, name: str, known) -> None:
    raise ValueError(f"unknown {kind} {name!r}; choose from {', '.join(known)}")

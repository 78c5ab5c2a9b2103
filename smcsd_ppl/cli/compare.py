"""``smcsd compare-constrained``: constrained generation, every method side by side."""

from __future__ import annotations

import argparse
import warnings

from ..names import STEERING_METHODS
from .loading import load_pair
from .options import SMC_DEFAULTS, command, smc_args, smc_config
from .util import check_threads, csv, cut_value, err, progress


def add_parser(sub) -> None:
    """Add the ``compare-constrained`` subcommand to the ``smcsd`` parser."""
    cc = command(
        sub,
        "compare-constrained",
        "constrained generation: SMC-SD programs vs LLaMPPL, genlm-control and rejection, one table",
    )
    cc.add_argument("--tasks", default="date,phone,json,short_words", help="comma-separated built-in tasks")
    cc.add_argument(
        "--methods", default=None, help=f"comma-separated (default: all): {', '.join(STEERING_METHODS)}"
    )
    side_by_side_args(cc, max_new_tokens=32)
    cc.set_defaults(run=_compare_constrained)
    cp = command(
        sub,
        "compare-program",
        "your own SMC-SD program under blocks and under token-level SMC: quality beside speed",
    )
    cp.add_argument(
        "program", help="FILE.py:NAME or MODULE:NAME, a program class (or function) taking the prompt"
    )
    cp.add_argument("--prompt", required=True, help="the prompt given to the program")
    cp.add_argument("--repeats", type=int, default=3, help="runs each way (medians reported)")
    smc_args(cp)
    cp.set_defaults(run=_compare_program)
    lp = command(
        sub,
        "compare-lipogram",
        'the no-"e" program three ways: a condition inside extend(), a regex, a condition after the block',
    )
    lp.add_argument("--forms", default="condition,regex,after", help="comma-separated forms to run")
    lp.add_argument("--limit", type=int, default=None, help="the first LIMIT of the 4 built-in prompts")
    side_by_side_args(lp, max_new_tokens=32)
    lp.set_defaults(run=_compare_lipogram)


def side_by_side_args(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    """The settings of a side-by-side comparison: N, K, one T for every model, budget, repeats, seed, cut."""
    p.add_argument("-n", "--particles", type=int, default=8, help="N particles, every method that has them")
    p.add_argument("-k", "--block-size", type=int, default=8, help="K for SMC-SD")
    p.add_argument("--temperature", type=float, default=0.7, help="T of every model")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="generation budget per run")
    p.add_argument("--repeats", type=int, default=1, help="runs of each method on each prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the first repeat (the next ones add 1)")
    p.add_argument(
        "--cut",
        type=cut_value,
        default=SMC_DEFAULTS.cut,
        help="SMC-SD's quality cut, as everywhere ('off': the paper's algorithm)",
    )


def _compare_constrained(args: argparse.Namespace) -> int:
    from ..bench.constrained import METHODS as CC_METHODS
    from ..bench.constrained import TASKS, compare_constrained

    tasks = [TASKS[t] if t in TASKS else _unknown("task", t, TASKS) for t in csv(args.tasks, str, "--tasks")]
    methods = csv(args.methods, str, "--methods") if args.methods else list(CC_METHODS)
    for m in methods:
        if m not in CC_METHODS:
            _unknown("method", m, CC_METHODS)
    check_threads(args.threads)
    pair = load_pair(args, torch_models=True)  # forwards are counted on the target's torch model
    total = args.repeats * len(tasks) * len(methods)
    with progress(total, "runs") as bar, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = [0]

        def tick(task: str, method: str, _rec) -> None:
            done[0] += 1
            bar(done[0])

        rows = compare_constrained(pair, tasks, methods, smc_config(args), repeats=args.repeats, on_run=tick)
    _print_table(rows, args)
    for line in _once(caught):
        err(line)
    return 0


def _once(caught) -> list[str]:
    """Each library warning once, cut at its first parenthesis (some carry a whole tokenized prompt)."""
    seen = {}
    for w in caught:
        head = str(w.message).split("(", 1)[0].strip()
        seen.setdefault((w.category.__name__, head), w)
    return [f"warning ({category}, shown once): {head} ..." for category, head in seen]


def _print_table(rows, args: argparse.Namespace) -> None:
    """The comparison as a markdown table, then the speed ratios per task."""
    from ..bench.constrained import summaries

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
    for line in summaries(rows, args.repeats):
        print(line)


def _compare_program(args: argparse.Namespace) -> int:
    from ..bench.programs import compare_program, summary

    factory = _load_program(args.program)
    config = smc_config(args)
    check_threads(args.threads)
    pair = load_pair(args)
    with progress(2 * args.repeats, "runs") as bar:
        done = [0]

        def tick(_mode: str) -> None:
            done[0] += 1
            bar(done[0])

        rows = compare_program(pair, lambda: factory(args.prompt), config, repeats=args.repeats, on_run=tick)
    print(
        f"N={config.n_particles}, K={config.block_size}, T_d={config.draft_temperature}, "
        f"T_t={config.target_temperature}; medians of {args.repeats} repeat(s)"
    )
    _program_table(rows, "mode")
    print(summary(rows))
    return 0


def _compare_lipogram(args: argparse.Namespace) -> int:
    from ..bench.lipogram import FORMS, PROMPTS, compare_lipogram

    forms = [f if f in FORMS else _unknown("form", f, FORMS) for f in csv(args.forms, str, "--forms")]
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    prompts = PROMPTS[: args.limit]
    check_threads(args.threads)
    pair = load_pair(args)
    with progress(args.repeats * len(prompts) * len(forms), "runs") as bar:
        done = [0]

        def tick(_form: str) -> None:
            done[0] += 1
            bar(done[0])

        rows = compare_lipogram(
            pair, smc_config(args), prompts=prompts, forms=forms, repeats=args.repeats, on_run=tick
        )
    print(
        f"N={args.particles}, K={args.block_size}, T={args.temperature} for both models, max "
        f"{args.max_new_tokens} new tokens, {len(prompts)} prompt(s) x {args.repeats} repeat(s): medians"
    )
    _program_table(rows, "form")
    regex = next((r.tokens_per_second for r in rows if r.mode == "regex"), 0.0)
    for r in rows:
        if r.mode != "regex" and regex and r.tokens_per_second:
            print(f"{r.mode} runs at {r.tokens_per_second / regex:.2f}x the regex form")
    return 0


def _program_table(rows, first: str) -> None:
    """Program rows as a markdown table (``first``: what the rows are)."""
    print(f"| {first} | valid | tokens/s | tokens | target calls | log p/tok | log Z | mean ESS | output |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        text = r.example.replace("|", "\\|").replace("\n", " ")[:40]
        print(
            f"| {r.mode} | {r.valid:.0%} | {r.tokens_per_second:.2f} | {r.tokens:.0f} | "
            f"{r.target_calls:.0f} | {r.loglik_per_token:.2f} | {r.log_z:.2f} | {r.mean_ess:.2f} | {text} |"
        )


def _load_program(spec: str):
    """The program class (or function) named by ``FILE.py:NAME`` or ``MODULE:NAME``."""
    import importlib
    import importlib.util
    import pathlib

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"give the program as FILE.py:NAME or MODULE:NAME, got {spec!r}")
    if where.endswith(".py"):
        path = pathlib.Path(where)
        if not path.is_file():
            raise ValueError(f"no such file: {where}")
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not callable(getattr(module, name, None)):
        raise ValueError(f"{where} has no program named {name!r}")
    return getattr(module, name)


def _unknown(kind: str, name: str, known) -> None:
    raise ValueError(f"unknown {kind} {name!r}; choose from {', '.join(known)}")

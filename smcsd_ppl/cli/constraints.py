"""Constraint benchmarks: ``constraint-engines``, ``grammar-exactness`` and ``compare-json``."""

from __future__ import annotations

import argparse

from ..names import ENGINE_NAMES, JSON_METHODS, JSON_TASKS
from .compare import side_by_side_args
from .loading import load_pair, load_target
from .options import command, smc_config, twist_arg
from .util import PROG, check_output_file, check_threads, csv, cut_value, progress, twist_value


def add_parsers(sub) -> None:
    """Add the three constraint subcommands to the ``smcsd`` parser."""
    eng = command(
        sub,
        "constraint-engines",
        "grammar engines on the target's tokenizer: build and mask times, JSON Schema coverage, licence",
    )
    eng.add_argument("--engines", default=",".join(ENGINE_NAMES), help="comma-separated engines")
    eng.add_argument("--repeats", type=int, default=5, help="builds timed per task (medians reported)")
    eng.add_argument(
        "--cycles-against",
        metavar="FILE.py",
        default=None,
        help="instead: time constrained SMC-SD runs (N=8 and 32, K=8, T=0.7, 40 tokens) per cycle, this "
        "package's engine against the RegexConstraint class of FILE.py (e.g. an older version's "
        "constraints.py)",
    )
    eng.set_defaults(run=_engines)

    ex = command(
        sub,
        "grammar-exactness",
        "SMC-SD vs locally masked decoding against the exact target x constraint (mock LMs, or a real "
        "target on a finite language)",
    )
    ex.add_argument("--particles", default="1,2,4,8,16,32,64", help="comma-separated N values")
    ex.add_argument("--modes", default="proposal,critic", help="comma-separated constraint modes")
    ex.add_argument(
        "--cuts", default="off", help="comma-separated quality cuts ('off': the paper's algorithm)"
    )
    ex.add_argument(
        "--twists",
        default="off",
        help="comma-separated twists (off, future-validity, structure, finite, lookahead, or depth-k: Phi "
        "estimated k tokens ahead): one row of each per mode and cut",
    )
    ex.add_argument(
        "--grammar",
        default="dyck",
        help="the case: dyck (balanced brackets) or garden (an automaton) on mock models; or "
        "comma-separated finite languages on the loaded target: capital, color, planet",
    )
    ex.add_argument("--runs", type=int, default=2000, help="seeded runs per setting")
    ex.add_argument(
        "--seeds", default="0", help="comma-separated seeds of the mock models and the runs: one table each"
    )
    ex.add_argument("--plot", default=None, help="write the TV-against-N plot to this PNG (the mock cases)")
    ex.set_defaults(run=_exactness)

    js = command(sub, "compare-json", "JSON extraction: SMC-SD vs AR under the mask vs genlm-control SMC")
    js.add_argument("--tasks", default="flat,nested", help="comma-separated: flat, nested")
    js.add_argument("--methods", default=",".join(JSON_METHODS), help="comma-separated methods")
    side_by_side_args(js, max_new_tokens=96)
    twist_arg(js)
    js.set_defaults(run=_compare_json)


def _engines(args: argparse.Namespace) -> int:
    if args.cycles_against:
        return _cycles(args)
    names = csv(args.engines, str, "--engines")
    for name in names:
        if name not in ENGINE_NAMES:
            raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINE_NAMES)}")
    target = load_target(args)
    from ..bench.engines import FEATURES, TASKS, measure_engine
    from ..models import eos_ids

    reports = [measure_engine(n, target.tokenizer, eos_ids(target), repeats=args.repeats) for n in names]
    print(
        f"{target.name}, vocabulary {len(target.tokenizer)}; build = compile + first mask, ms (median of "
        f"{args.repeats}); masks = fill and unpack to [N, V] bool for N fresh matchers, ms (median)"
    )
    sizes = sorted({n for r in reports for _, n in r.mask_seconds})
    cols = ["engine", "licence", "tokenizer s"] + [f"build {t}" for t in TASKS]
    cols += [f"masks {t} N={n}" for t in TASKS for n in sizes]
    print("| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|")
    for r in reports:
        if r.error:
            print(f"| {r.name} | {r.error} |" + " |" * (len(cols) - 2))
            continue
        cells = [f"{r.name} {r.version}", r.licence, f"{r.tokenizer_seconds:.2f}"]
        cells += [_ms(r.build_seconds.get(t)) for t in TASKS]
        cells += [_ms(r.mask_seconds.get((t, n))) for t in TASKS for n in sizes]
        print("| " + " | ".join(cells) + " |")
    print("\n| JSON Schema feature | " + " | ".join(r.name for r in reports) + " |")
    print("|---" * (len(reports) + 1) + "|")
    for feature in FEATURES:
        print(f"| {feature} | " + " | ".join(r.coverage.get(feature, "-") for r in reports) + " |")
    return 0


def _cycles(args: argparse.Namespace) -> int:
    from ..bench.mask_cycles import compare_cycles, load_regex_class
    from ..config import SMCConfig

    other = load_regex_class(args.cycles_against)
    pair = load_pair(args)
    print(f"constraint time per SMC cycle, ms; other = the RegexConstraint of {args.cycles_against}")
    print("| N | task | engine | build s | first run, ms/cycle | warm runs, median ms/cycle |")
    print("|---|---|---|---|---|---|")
    for n in (8, 32):
        config = SMCConfig(  # no twist: the masks alone are compared
            n_particles=n,
            block_size=8,
            draft_temperature=0.7,
            target_temperature=0.7,
            max_new_tokens=40,
            twist=None,
        )
        for r in compare_cycles(pair, other, config):
            print(
                f"| {n} | {r['task']} | {r['engine']} | {r['build_s']:.3f} | {r['first_ms']:.2f} | "
                f"{r['warm_ms']:.2f} |"
            )
    return 0


def _ms(seconds: float | None) -> str:
    return "failed" if seconds is None else f"{1000 * seconds:.2f}"


def _exactness(args: argparse.Namespace) -> int:
    ns = csv(args.particles, int, "--particles")
    modes = csv(args.modes, str, "--modes")
    cuts = [cut_value(c) for c in csv(args.cuts, str, "--cuts")]
    twists = [_twist(t) for t in csv(args.twists, str, "--twists")]
    seeds = csv(args.seeds, int, "--seeds")
    if args.runs < 1 or min(ns) < 1:
        raise ValueError("--runs and every N must be at least 1")
    from ..bench.grammar_real import LANGUAGES

    if all(name in LANGUAGES for name in csv(args.grammar, str, "--grammar")):
        from .exactness_real import real_exactness

        return real_exactness(args, ns, twists, seeds)
    if args.plot:
        check_output_file(args.plot, "--plot")
    from ..bench.grammar_exact import GRAMMARS, grammar_exactness, plot_exactness

    if args.grammar not in GRAMMARS:
        known = ", ".join([*GRAMMARS, *LANGUAGES])
        raise ValueError(f"unknown --grammar {args.grammar!r}; choose from {known}")
    tables = []
    for seed in seeds:
        rows, refs = grammar_exactness(
            ns, modes, cuts, runs=args.runs, seed=seed, twists=twists, grammar=args.grammar
        )
        tables.append((seed, rows, refs))
        print(
            f"{PROG} grammar-exactness, {args.grammar}, seed {seed}: P_p(valid) = {refs['z']:.4f}; TV from "
            f"p x phi of the local projection (AR / SD under the mask, exact) {refs['local_tv']:.3f}; of the "
            f"engine's AR under the mask (sampled) {refs['ar_masked_tv']:.3f} (from the exact projection: "
            f"{refs['ar_vs_local_tv']:.3f}); sampling noise at {args.runs} runs {refs['noise']:.3f}"
        )
        _table(rows, ns)
    if len(seeds) > 1:
        _summary(tables, ns)
    if args.plot:
        plot_exactness(tables[0][1], tables[0][2], args.plot)
        print(f"wrote {args.plot} (seed {seeds[0]})")
    return 0


def _twist(text: str) -> str | None:
    from ..bench.grammar_exact import depth_of

    name = text.strip().lower()
    try:
        return name if depth_of(name) else twist_value(text)
    except (argparse.ArgumentTypeError, ValueError) as err:
        raise ValueError(f"--twists: {err}") from None


def _table(rows, ns) -> None:
    """One seed's rows: N down, methods across."""
    methods = list(dict.fromkeys(r.method for r in rows))
    print("| N | " + " | ".join(methods) + " |\n" + "|---" * (len(methods) + 1) + "|")
    for n in ns:
        cells = [_cell(next(r for r in rows if r.method == m and r.n == n)) for m in methods]
        print(f"| {n} | " + " | ".join(cells) + " |")


def _summary(tables, ns) -> None:
    """Across seeds: each method's TV per seed, and how far above its seed's sampling noise."""
    seeds = [s for s, _, _ in tables]
    print(
        f"\nTV from p x phi on every seed ({', '.join(map(str, seeds))}); in brackets the sampling noise of "
        "each seed's runs, the floor no sampler goes under"
    )
    print(
        "| method | N | " + " | ".join(f"seed {s}" for s in seeds) + " |\n" + "|---" * (len(seeds) + 2) + "|"
    )
    noise = " | ".join(f"({refs['noise']:.3f})" for _, _, refs in tables)
    local = " | ".join(f"{refs['local_tv']:.3f}" for _, _, refs in tables)
    print(f"| AR / SD under the mask (exact) | any | {local} |\n| sampling noise | | {noise} |")
    for method in dict.fromkeys(r.method for r in tables[0][1]):
        for n in ns:
            tvs = [
                next(r for r in rows if r.method == method and r.n == n).tv_global for _, rows, _ in tables
            ]
            print(f"| {method} | {n} | " + " | ".join(f"{tv:.3f}" for tv in tvs) + " |")


def _cell(row) -> str:
    """TV from p x phi, and the share of requests that returned nothing where some did."""
    return f"{row.tv_global:.3f}" + (f" ({row.empty:.0%} empty)" if row.empty else "")


def _compare_json(args: argparse.Namespace) -> int:
    tasks, methods = csv(args.tasks, str, "--tasks"), csv(args.methods, str, "--methods")
    for m in methods:
        if m not in JSON_METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(JSON_METHODS)}")
    for t in tasks:
        if t not in JSON_TASKS:
            raise ValueError(f"unknown task {t!r}; choose from {', '.join(JSON_TASKS)}")
    check_threads(args.threads)
    pair = load_pair(args)
    from ..bench.json_tasks import TASKS, compare_json, summarize

    config = smc_config(args, twist=None)  # the twisted rows come as variants
    twist = getattr(args, "twist", None)  # the twisted rows: variants of the untwisted ones
    rows = len(methods) + (twist is not None) * sum(m in ("smcsd", "smcsd_paper") for m in methods)
    total = args.repeats * rows * sum(len(TASKS[t][2]) for t in tasks)
    with progress(total, "runs") as bar:
        done = [0]

        def tick(_run) -> None:
            done[0] += 1
            bar(done[0])

        runs = compare_json(pair, tasks, methods, config, repeats=args.repeats, on_run=tick, twist=twist)
    print(
        f"N={args.particles}, K={args.block_size}, T={args.temperature}, cut {args.cut}, max "
        f"{args.max_new_tokens} new tokens, {args.dtype} on {args.device}, {args.repeats} repeat(s). "
        "valid = returned text is JSON valid under the schema; fields = share of the answer's fields right; "
        "tokens/s = tokens per particle (EOS included) over wall seconds, all runs of the row."
    )
    print("| task | method | valid | fields | tokens/s | s (median) | runs |\n|---|---|---|---|---|---|---|")
    for s in summarize(runs):
        print(
            f"| {s.task} | {s.method} | {s.validity:.2f} | {s.accuracy:.2f} | {s.tokens_per_second:.1f} | "
            f"{s.seconds:.2f} | {s.runs} |"
        )
    return 0

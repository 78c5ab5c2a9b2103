"""``smcsd grammar-exactness --grammar capital|color|planet``: the real-model mode."""

from __future__ import annotations

import argparse

from .loading import load_pair
from .util import PROG, check_threads, csv, progress


def real_exactness(
    args: argparse.Namespace, ns: list[int], twists: list[str | None], seeds: list[int]
) -> int:
    """SMC-SD against the exact conditional of a finite language on the loaded target."""
    from ..bench.grammar_real import LANGUAGES, real_exactness

    if args.modes != "proposal,critic" or args.cuts != "off" or args.plot:
        raise ValueError(
            "--modes, --cuts and --plot are the mock cases' own: a real language runs proposal mode, "
            "default cut, and prints its tables"
        )
    check_threads(args.threads)
    languages = [LANGUAGES[name] for name in csv(args.grammar, str, "--grammar")]
    pair = load_pair(args)
    print(
        f"{PROG} grammar-exactness on {pair.target.name} (draft: {pair.draft.name}), T = 1, default cut, "
        f"{args.runs} requests per cell, seed {seeds[0]}. TV of the returned texts from the exact "
        "conditional p(x | valid); masked decoding's law is computed exactly, not sampled.",
        flush=True,
    )
    with progress(len(languages) * len(ns) * len(twists), "cells") as bar:
        done = [0]

        def tick(_row) -> None:
            done[0] += 1
            bar(done[0])

        for lang in languages:  # each table as soon as it is done: an interrupted run keeps them
            rows, refs = real_exactness(pair, [lang], ns, twists, runs=args.runs, seed=seeds[0], on_row=tick)
            _table(lang, refs[lang.name], rows, ns, args.runs, seeds[0])
    return 0


def _table(lang, ref, rows, ns: list[int], runs: int, seed: int) -> None:
    from ..bench.grammar_exact import sampling_noise, total_variation

    methods = list(dict.fromkeys(r.method for r in rows))
    print(
        f"\n{lang.name}: {lang.prompt!r} -> {' | '.join(lang.choices)}; P(valid) = {ref.z:.3g} over "
        f"{ref.paths} token paths (pruned mass {ref.pruned:.1g} of it); masked decoding "
        f"{total_variation(ref.conditional, ref.masked):.3f} from the conditional; sampling noise "
        f"at {runs} runs {sampling_noise(ref.conditional, runs, seed):.3f}"
    )
    print("| N | " + " | ".join(methods) + " |\n" + "|---" * (len(methods) + 1) + "|")
    for n in ns:
        cells = [next(r for r in rows if (r.method, r.n) == (m, n)) for m in methods]
        print(f"| {n} | " + " | ".join(_cell(r) for r in cells) + " |", flush=True)


def _cell(row) -> str:
    return f"{row.tv:.3f}" + (f" ({row.empty:.0%} empty)" if row.empty else "")

"""``smcsd fidelity``: SMC-SD's accuracy and tokens per target call against draft quality."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

from .loading import load_pair
from .options import command, grid_args, prompt_args, smc_config
from .util import check_output_file, check_threads, csv, cut_value, err, progress


def add_parser(sub) -> None:
    """Add the ``fidelity`` subcommand to the ``smcsd`` parser."""
    fid = command(
        sub,
        "fidelity",
        "the fidelity map: accuracy and tokens/target call vs draft agreement, N, K and the cut",
    )
    fid.add_argument("--dataset", default="short_answer", help="a dataset with reference answers")
    prompt_args(fid, per_category=5)
    fid.add_argument(
        "--lams", default="0,0.5,0.8,0.95", help="comma-separated mixture weights of the target in the draft"
    )
    grid_args(fid, particles="8", block_sizes="8")
    fid.add_argument("--cuts", default="off,0.3", help="comma-separated cut thresholds ('off': none)")
    fid.add_argument("--cut-divergence", default="tv", help="the divergence the cuts bound: tv, renyi2, kl")
    fid.add_argument("--temperature", type=float, default=0.7, help="T_d = T_t")
    fid.add_argument("--max-new-tokens", type=int, default=24, help="generation budget per prompt")
    fid.add_argument("--seed", type=int, default=0, help="seed of every run")
    fid.add_argument("--out", required=True, help="JSONL file, one line per map cell (appended)")
    fid.set_defaults(run=_fidelity)


def _fidelity(args: argparse.Namespace) -> int:
    from ..bench import load_prompts
    from ..bench.fidelity import fidelity_map

    cells = list(
        itertools.product(
            csv(args.lams, float, "--lams"),
            csv(args.particles, int, "--particles"),
            csv(args.block_sizes, int, "--block-sizes"),
            [cut_value(c) for c in csv(args.cuts, str, "--cuts")],
        )
    )
    base = smc_config(args)  # T_d = T_t = --temperature
    prompts = [
        p for p in load_prompts(args.dataset, limit=args.limit, per_category=args.per_category) if p.answer
    ]
    if not prompts:
        raise ValueError(f"{args.dataset} has no prompts with reference answers")
    check_output_file(args.out, "--out")
    check_threads(args.threads)
    pair = load_pair(args, torch_models=True)
    print("| lam | agreement | N | K | cut | accuracy | tokens/target call | mean ESS/N | collapsed |")
    print("|---|---|---|---|---|---|---|---|---|")  # cut: the threshold on --cut-divergence
    with progress(len(cells), "cells") as bar, open(args.out, "a") as out:
        done = [0]

        def write(point) -> None:
            out.write(json.dumps(dataclasses.asdict(point)) + "\n")
            out.flush()
            done[0] += 1
            bar(done[0])
            cut = "off" if point.cut is None else point.cut
            print(
                f"| {point.lam} | {point.agreement:.2f} | {point.n_particles} | {point.block_size} | {cut} "
                f"| {point.accuracy:.2f} | {point.tokens_per_target_call:.2f} "
                f"| {point.mean_ess_fraction:.2f} | {point.collapsed:.2f} |",
                flush=True,
            )

        fidelity_map(pair, prompts, cells, base, on_point=write)
    err(f"{len(cells)} cells x {len(prompts)} prompts -> {args.out}")
    return 0

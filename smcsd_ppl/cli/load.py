"""``smcsd load-test``: concurrent clients against ``smcsd serve``, against one batch of the same requests."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

from .loading import load_notes, pair_options, set_threads
from .options import model_args, smc_args, smc_config
from .util import check_output_dir, csv, err, status


def add_parser(sub) -> None:
    """Add ``load-test`` to the ``smcsd`` parser."""
    p = sub.add_parser(
        "load-test",
        help="throughput and latency of smcsd serve at 1, 2, 4, 8, 16 concurrent clients (openai client)",
        description="The same requests (streamed or not, regex-constrained or not, one seed each) at each "
        "level of concurrency; level 1 sends them one after another. Every answer is checked to be its "
        "request's. Without --url a server runs here (its engine in a process of its own, as smcsd "
        "serve runs it), and the same requests given to its engine at once measure the engine's "
        "ceiling (one batch). Writes load.jsonl, load.md and load.png.",
    )
    p.add_argument("--out-dir", required=True, help="where to write load.jsonl, load.md and load.png")
    p.add_argument("--requests", type=int, default=16, help="requests sent at each level")
    p.add_argument("--levels", default="1,2,4,8,16", help="comma-separated numbers of concurrent clients")
    p.add_argument("--seed", type=int, default=0, help="request i's seed is this + i")
    p.add_argument("--url", default=None, help="a running server's /v1 URL (default: serve in this process)")
    p.add_argument("--api-key", default=None, help="the server's bearer token (with --url)")
    p.add_argument(
        "--core",
        choices=("process", "thread"),
        default="process",
        help="without --url: the served engine's core in a process of its own (as smcsd serve runs it) "
        "or a thread",
    )
    g = p.add_argument_group("faults (--faults): good requests mixed with broken ones, round after round")
    g.add_argument(
        "--faults",
        action="store_true",
        help="instead of the levels: clients mixing good requests (chat, streamed, JSON Schema) with faults "
        "(dropped streams, bodies that are not JSON, bad schemas and settings, an unknown model, a 60k "
        "prompt), then a burst at once; per kind the status codes, latency, 5xx and hangs, and after each "
        "round the gauges and the server's memory (faults.jsonl, faults.md)",
    )
    g.add_argument("--rounds", type=int, default=3, help="rounds (20 or more: a soak)")
    g.add_argument("--clients", type=int, default=16, help="concurrent clients in a round")
    g.add_argument("--per-client", type=int, default=3, help="requests each client sends in a round")
    g.add_argument("--burst", type=int, default=80, help="good requests sent at once at the end of a round")
    g.add_argument(
        "--timeout", type=float, default=300, help="seconds before an unanswered request is a hang"
    )
    g.add_argument("--max-queue", type=int, default=64, help="the server's --max-queue")
    g.add_argument("--max-rows", type=int, default=512, help="the server's --max-rows")
    model_args(p)
    smc_args(p, seed=False)  # the requests' N, K, temperatures and max tokens; the server's fixed fields
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run every level, write the files, print the table; exit 1 if any answer is wrong or missing."""
    from ..bench.load import ceiling, run_load, workload
    from ..bench.load_report import load_table, write_load_report

    config = smc_config(args)
    if args.faults:
        return _faults(args, config)
    levels = csv(args.levels, int, "--levels")
    if min(levels) < 1 or args.requests < 1:
        raise ValueError("--levels and --requests must be at least 1")
    check_output_dir(args.out_dir, "--out-dir")
    requests = workload(args.requests, args.seed)

    def show(summary: dict) -> None:
        speed, errors = summary["tokens_per_second"], summary["errors"]
        err(f"{summary['clients']} clients: {speed:.1f} tokens/s, {errors} errors")

    if args.url:
        target = _target(args.url, _served_model(args.url, args.api_key), config, args.api_key)
        records, summaries, problems = run_load(target, requests, levels, show)
        top = None
    else:
        with _in_process(args, config, len(requests)) as (url, model, engine):
            records, summaries, problems = run_load(_target(url, model, config), requests, levels, show)
            # the server idle: the same requests as one batch on the same engine
            top = ceiling(engine, dataclasses.replace(config, seed=args.seed), requests)
    settings = {"requests": args.requests, "levels": levels, "url": args.url} | dataclasses.asdict(config)
    paths = write_load_report(args.out_dir, records, summaries, top, settings)
    print(load_table(summaries, top), end="")
    for problem in problems:
        err(f"problem: {problem}")
    err(f"wrote {', '.join(str(p) for p in paths)}")
    return 1 if problems else 0


def _target(url: str, model: str, config, api_key: str | None = None):
    from ..bench.load import Target

    return Target(
        url,
        model,
        config.max_new_tokens,
        config.target_temperature,
        config.draft_temperature,
        config.n_particles,
        config.block_size,
        api_key or "none",
    )


def _served_model(url: str, api_key: str | None) -> str:
    import openai

    return openai.OpenAI(base_url=url, api_key=api_key or "none").models.list().data[0].id


@contextlib.contextmanager
def _in_process(args: argparse.Namespace, config, requests: int):
    """``smcsd serve`` per the options, on a free local port while the block runs: (url, model, engine)."""
    from ..serving.server import BackgroundServer
    from ..serving.settings import PairSpec, ServeSettings, build_server

    set_threads(args)
    limits = dict(max_queue=max(args.max_queue, requests), max_rows=args.max_rows)
    settings = ServeSettings(pair=PairSpec(**pair_options(args)), defaults=config, core=args.core, **limits)
    where = "in a process of its own" if args.core == "process" else "here"
    with status(f"loading models ({where})"), load_notes():
        app = build_server(settings)
    service = app.state.service
    with BackgroundServer(app) as server:
        yield server.url + "/v1", service.model_name, service.engine


def _faults(args: argparse.Namespace, config) -> int:
    """The fault load test, round after round; exit 1 on a 5xx, a hang or a server not idle after."""
    import json
    import os
    from pathlib import Path

    from ..bench import faults

    for name in ("rounds", "clients", "per_client"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    check_output_dir(args.out_dir, "--out-dir")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records, rounds = [], []
    with _in_process(args, config, 0) as (url, model, engine), (out / "faults.jsonl").open("w") as f:
        server = faults.Server(url.removesuffix("/v1"), model, config.max_new_tokens)
        pids = [os.getpid()] + ([engine.pid] if getattr(engine, "pid", None) else [])
        for r in range(args.rounds):
            got = faults.run_round(server, args.clients, args.per_client, args.burst, r, args.timeout)
            summary = {"kind": "round", "round": r + 1, "gauges": faults.gauges_after(server)}
            summary["rss_mb"] = faults.resident_mb(pids)
            for record in [*got, summary]:
                f.write(json.dumps(record | {"round": r + 1}) + "\n")
            records += got
            rounds.append(summary)
            err(f"round {r + 1}: {len(got)} requests, server {summary['rss_mb']:.0f} MB")
    rows = faults.summarize(records)
    table = faults.fault_table(rows, rounds)
    if len(rounds) >= 5:
        table += f"\nMemory levels off over the last 5 rounds (within 5%): {faults.soak_levels_off(rounds)}\n"
    (out / "faults.md").write_text(table, encoding="utf-8")
    print(table, end="")
    found = faults.problems(rows, rounds)
    for problem in found:
        err(f"problem: {problem}")
    return 1 if found else 0

"""``smcsd load-test``: concurrent clients against ``smcsd serve``, against one batch of the same requests."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

from .loading import pair_options, set_threads
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
        "--engine",
        choices=("process", "thread"),
        default="process",
        help="without --url: the served engine in a process of its own (as smcsd serve runs it) or a thread",
    )
    model_args(p)
    smc_args(p, seed=False)  # the requests' N, K, temperatures and max tokens; the server's fixed fields
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run every level, write the files, print the table; exit 1 if any answer is wrong or missing."""
    from ..bench.load import ceiling, run_load, workload
    from ..bench.load_report import load_table, write_load_report

    config = smc_config(args)
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
    settings = ServeSettings(
        pair=PairSpec(**pair_options(args)), defaults=config, max_queue=max(64, requests), engine=args.engine
    )
    with status(f"loading models ({'in an engine process' if args.engine == 'process' else 'here'})"):
        app = build_server(settings)
    service = app.state.service
    with BackgroundServer(app) as server:
        yield server.url + "/v1", service.model_name, service.engine

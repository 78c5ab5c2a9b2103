"""``smcsd serve``: the pair behind an OpenAI-compatible HTTP API (see docs/serving.md)."""

from __future__ import annotations

import argparse
import os

from . import serve_ray
from .loading import load_pair
from .options import model_args, smc_args, smc_config
from .server import serving_app
from .util import check_threads, err

DEFAULT_PORT = 8000
API_KEY_VARIABLE = "SMCSD_API_KEY"


def add_parser(sub) -> None:
    """Add ``serve`` to the ``smcsd`` parser."""
    serve = sub.add_parser(
        "serve",
        help="serve the pair over HTTP: OpenAI's /v1/chat/completions and /v1/completions",
        description="Requests join the running batch at each cycle boundary, each with its own settings "
        "and seed. The sampling options are the defaults of requests that do not set them; alpha, cut, "
        "resampling, ESS threshold, selection and token level hold for every request.",
    )
    server_args(serve)
    serve_ray.ray_server_args(serve)
    model_args(serve)
    smc_args(serve, seed=False)  # a request without a seed gets a fresh one
    serve.set_defaults(run=run)


def server_args(p: argparse.ArgumentParser) -> None:
    """The ``server`` group: where to listen, who may call, and the limits."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on (0: a free one)")
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE),
        help=f"require this bearer token on the /v1 routes (default: ${API_KEY_VARIABLE}, else none)",
    )
    g.add_argument("--model-name", default=None, help="the model id clients name (default: the target's)")
    g.add_argument("--max-queue", type=int, default=64, help="most requests waiting; more get 429")
    g.add_argument("--max-rows", type=int, default=512, help="most KV-cache rows in use (N per request)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body; more get 413")


def check_server_args(args: argparse.Namespace) -> None:
    """Refuse bad limits and ports before any model loads."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("max_queue", "max_rows", "max_body_bytes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty")


def run(args: argparse.Namespace) -> int:
    """Load the pair, start the scheduler, and serve until Ctrl-C (running requests get time to finish)."""
    from ..serving.server import bind, url_of, uvicorn_server

    config = smc_config(args)
    check_threads(args.threads)
    check_server_args(args)
    serve_ray.check_ray_args(args)
    if args.ray:
        return serve_ray.run(args)
    sock = bind(args.host, args.port)  # a port in use fails before the models load
    pair = load_pair(args)
    app = serving_app(pair, config, args)
    name = app.state.service.model_name
    print(f"serving {name} at {url_of(sock)}/v1 (OpenAI API; Ctrl-C stops)", flush=True)
    try:
        uvicorn_server(app).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down
        pass
    err("stopped")
    return 0

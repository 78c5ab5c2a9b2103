"""``smcsd serve``: the pair behind an OpenAI-compatible HTTP API (see docs/serving.md)."""

from __future__ import annotations

import argparse
import os

from . import serve_ray
from .loading import load_notes, pair_options, set_threads
from .options import model_args, smc_args, smc_config
from .util import PROG, check_threads, err, say_error, status

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
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the target, as --target (vLLM's `serve MODEL`)",
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
    g.add_argument(
        "--grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM or Ctrl-C: new requests get 503, running ones may finish for this long, then "
        "end with their text so far and finish_reason 'abort' (default: %(default)s)",
    )
    g.add_argument(
        "--core",
        choices=("process", "thread"),
        default="process",
        help="where the engine's core runs its cycles: a process of its own (default; HTTP never waits "
        "on them) or a thread of this one",
    )
    g.add_argument(
        "--core-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a core process that ends no cycle for this long while requests run is killed as hung, "
        "and the server exits 1 for its supervisor to restart it, as when it dies (0: never; "
        "default: %(default)s)",
    )


def serve_settings(args: argparse.Namespace, *, core: str | None = None):
    """The server's typed settings from the options (checked, before any model loads)."""
    from ..serving.settings import PairSpec, ServeSettings

    if not 0 <= getattr(args, "port", 0) <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if getattr(args, "grace_seconds", 0) < 0:
        raise ValueError(f"--grace-seconds must be at least 0, got {args.grace_seconds}")
    if getattr(args, "model", None) is not None:
        if args.target not in (None, args.model):
            raise ValueError(f"MODEL {args.model!r} and --target {args.target!r} name two targets: give one")
        args.target = args.model
    options = pair_options(args)
    return ServeSettings(
        pair=PairSpec(
            **{k: v for k, v in options.items() if k != "vllm_options"}, vllm_options=options["vllm_options"]
        ),
        defaults=smc_config(args),
        model_name=args.model_name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_rows=args.max_rows,
        max_body_bytes=args.max_body_bytes,
        core=core or args.core,
        core_timeout=args.core_timeout,
    )


def run(args: argparse.Namespace) -> int:
    """Load the pair, start the scheduler, and serve until Ctrl-C (running requests get time to finish)."""
    from ..serving.server import bind, url_of, uvicorn_server
    from ..serving.settings import build_server

    check_threads(args.threads)
    settings = serve_settings(args, core="thread" if args.ray else None)
    serve_ray.check_ray_args(args)
    if args.ray:
        return serve_ray.run(args, settings)
    sock = bind(args.host, args.port)  # a port in use fails before the models load
    set_threads(args)
    where = "in a process of its own" if settings.core == "process" else "here"
    with status(f"loading models ({where})"), load_notes():
        app = build_server(settings)
    service = app.state.service
    err(service.engine.pair.facts.kv_note(settings.max_rows))
    if _emulates(settings.pair):
        err(
            f"note: this CPU has no native {settings.pair.dtype} matrix products: a batch of rows costs "
            "nearly as much per row as one alone; --dtype float32 serves concurrent requests faster"
        )
    print(f"serving {service.model_name} at {url_of(sock)}/v1 (OpenAI API; Ctrl-C stops)", flush=True)
    server = uvicorn_server(app, grace_seconds=args.grace_seconds)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down
        pass
    if server.engine_died:
        say_error(
            f"{PROG} serve: error: the engine process ended ({service.engine.exit_note}); stopped, so that "
            "a supervisor can restart the server"
        )
        return 1
    err("stopped")
    return 0


def _emulates(spec) -> bool:
    """Whether the pair runs half precision that this CPU emulates (so batched rows are dear)."""
    from ..backends.cpu import native_matmul
    from ..models.loading import _parse_dtype

    return (
        spec.device.startswith("cpu")
        and spec.backend == "hf"
        and not native_matmul(_parse_dtype(spec.dtype, spec.device))
    )

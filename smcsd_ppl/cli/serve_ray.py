"""``smcsd serve --ray``: the same app on Ray Serve replicas, each with its own pair and batch.

Ray's proxy spreads requests over the replicas; each replica is ``smcsd serve`` in one
process (a pair, its engine, the ASGI app), so a request's output per seed is the
single-process server's. Without ``RAY_ADDRESS`` a local cluster starts.
"""

from __future__ import annotations

import argparse
import os
import time

from .util import err


def ray_server_args(p: argparse.ArgumentParser) -> None:
    """The ``Ray Serve`` group of ``smcsd serve``."""
    g = p.add_argument_group("Ray Serve (pip install 'smcsd_ppl[ray]')")
    g.add_argument(
        "--ray", action="store_true", help="serve from Ray Serve replicas (RAY_ADDRESS or a local cluster)"
    )
    g.add_argument(
        "--replicas", type=int, default=1, help="replicas, each with its own pair and batch (with --ray)"
    )
    g.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs each replica holds (with --ray)")
    g.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs each replica holds (with --ray)")


def check_ray_args(args: argparse.Namespace) -> None:
    """Refuse Ray settings that cannot hold, before anything starts."""
    if not args.ray:
        if args.replicas != 1 or args.gpus_per_replica or args.cpus_per_replica != 1.0:
            raise ValueError("--replicas, --gpus-per-replica and --cpus-per-replica go with --ray")
        return
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.gpus_per_replica < 0 or args.cpus_per_replica <= 0:
        raise ValueError("--gpus-per-replica must be >= 0 and --cpus-per-replica > 0")


def start(args: argparse.Namespace, settings) -> str:
    """Deploy the app of ``settings`` on ``args.replicas`` Ray Serve replicas; the URL it answers at."""
    try:
        import ray
        from ray import serve
    except ImportError as error:
        raise ValueError("--ray needs Ray Serve: pip install 'smcsd_ppl[ray]'") from error
    ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    deployment = serve.deployment(
        serve.ingress(replica_builder(settings))(),
        name="smcsd",
        num_replicas=args.replicas,
        ray_actor_options={"num_gpus": args.gpus_per_replica, "num_cpus": args.cpus_per_replica},
    )
    serve.run(deployment.bind(), name="smcsd", route_prefix="/", blocking=False)
    return f"http://{args.host}:{args.port}"


def replica_builder(settings):
    """What a replica runs to build its app: the server of ``smcsd serve``, its engine in the replica."""

    def build():
        from ..serving.settings import build_server

        return build_server(settings)

    return build


def run(args: argparse.Namespace, settings) -> int:
    """Serve ``settings`` on Ray until Ctrl-C, then take the application down."""
    from ray import serve

    url = start(args, settings)
    print(
        f"serving at {url}/v1 from {args.replicas} Ray Serve replica(s) (OpenAI API; Ctrl-C stops)",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.delete("smcsd")
        serve.shutdown()
    err("stopped")
    return 0

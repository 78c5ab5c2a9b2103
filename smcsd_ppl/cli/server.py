"""The app ``smcsd serve`` runs, in one process or on each Ray Serve replica."""

from __future__ import annotations

import argparse


def serving_app(pair, config, args: argparse.Namespace):
    """The ASGI app over a new scheduler of ``pair`` (the app closes it when it shuts down)."""
    from ..serving.app import build_app
    from ..serving.scheduler import Scheduler

    scheduler = Scheduler(pair, config, max_queue=args.max_queue, max_rows=args.max_rows)
    pair.use_scheduler(scheduler)  # the pair's own calls share the server's batch
    return build_app(
        scheduler,
        pair,
        model_name=args.model_name or pair.target.name,
        defaults=config,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
    )

"""``smcsd device-check``: the one-shot backend and speed check, as one JSON object."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    """Add the ``device-check`` subcommand to the ``smcsd`` parser."""
    dc = sub.add_parser(
        "device-check",
        help="bf16 backend equivalence and AR / SD / SMC-SD speed on random 8B/1B-shaped models (JSON)",
    )
    dc.add_argument("--device", default=None, help="cuda when there is one, else cpu (tiny shapes)")
    dc.add_argument("--tiny", action="store_true", help="tiny shapes (always on a CPU)")
    dc.add_argument("--max-new-tokens", type=int, default=128, help="tokens per timed run")
    dc.add_argument("--prompt-tokens", type=int, default=128, help="random prompt length")
    dc.add_argument("--repeats", type=int, default=3, help="timed runs per method (medians)")
    dc.add_argument(
        "--backend",
        choices=("hf", "vllm"),
        default="hf",
        help="vllm: also time AR, SD and SMC-SD on vLLM engines over the same models",
    )
    dc.set_defaults(run=_device_check)


def _device_check(args: argparse.Namespace) -> int:
    from ..bench.device_check import CheckSettings, check

    settings = CheckSettings(
        tiny=args.tiny,
        max_new_tokens=args.max_new_tokens,
        prompt_tokens=args.prompt_tokens,
        repeats=args.repeats,
        backend=args.backend,
    )
    report = check(args.device, settings)
    print(json.dumps(report))
    return 0 if report["equivalence_ok"] else 1

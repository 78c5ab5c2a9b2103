"""The ``smcsd`` command line: the only part of the package that prints."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from contextlib import contextmanager

from .config import RESAMPLING_SCHEMES, SELECTIONS, SMCConfig
from .methods import METHODS

SPEED_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Describe the water cycle to a ten-year-old.",
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``smcsd`` (also used to document the CLI)."""
    parser = argparse.ArgumentParser(
        prog="smcsd", description="SMC speculative decoding: fast sampling with N draft particles."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a continuation of a prompt")
    gen.add_argument("prompt", help="the prompt (wrapped in the chat template of instruct models)")
    gen.add_argument(
        "--method",
        choices=list(METHODS),
        default="smcsd",
        help="; ".join(f"{m.name}: {m.summary}" for m in METHODS.values()),
    )
    _model_args(gen)
    _smc_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.set_defaults(run=_generate)

    speed = sub.add_parser("speed", help="tokens/s of SMC-SD vs AR, exact SD and HF generate(), side by side")
    _model_args(speed)
    _smc_args(speed)
    speed.add_argument("--repeats", type=int, default=3, help="runs per prompt and method (medians reported)")
    speed.add_argument("--prompt", action="append", help="prompt to time (repeatable; default: 3 built-in)")
    speed.set_defaults(run=_speed)
    return parser


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument(
        "--target", default=None, help="hub id or local path (default: embedded SmolLM2-135M-Instruct)"
    )
    g.add_argument(
        "--draft", default=None, help="hub id, local path, or layers:N (default: target's first 2 layers)"
    )
    g.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float32 or float16")
    g.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")


def _smc_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--particles", type=int, default=8, help="N particles (default 8)")
    g.add_argument("-k", "--block-size", type=int, default=8, help="K drafted tokens per cycle (default 8)")
    g.add_argument(
        "--ess-threshold", type=float, default=0.5, help="resample when ESS < this x N (default 0.5)"
    )
    g.add_argument("--resampling", choices=RESAMPLING_SCHEMES, default="systematic")
    g.add_argument("--draft-temperature", type=float, default=0.7, help="T_d (default 0.7)")
    g.add_argument("--target-temperature", type=float, default=0.7, help="T_t (default 0.7)")
    g.add_argument("--alpha", type=float, default=1.0, help="power on the target (default 1)")
    g.add_argument(
        "--selection", choices=SELECTIONS, default="sample", help="how the output particle is chosen"
    )
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="always emit --max-new-tokens tokens")


def _config(args: argparse.Namespace) -> SMCConfig:
    return SMCConfig(
        n_particles=args.particles,
        block_size=args.block_size,
        ess_threshold=args.ess_threshold,
        resampling=args.resampling,
        draft_temperature=args.draft_temperature,
        target_temperature=args.target_temperature,
        alpha=args.alpha,
        selection=args.selection,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )


def _load(args: argparse.Namespace):
    from .generate import SMCSD

    with _status(f"loading models on {args.device} ({args.dtype})"):
        pair = SMCSD.load(
            args.target, args.draft, device=args.device, dtype=args.dtype, chat=not args.no_chat
        )
    _err(f"target: {pair.target.name} [{pair.target.source}]")
    _err(f"draft:  {pair.draft.name} [{pair.draft.source}]")
    if pair.draft.is_slice:
        _err(
            "note: a layer slice of the target is a WEAK draft (it agrees with the target on few tokens); "
            "expect low ESS and outputs closer to the draft than to the target. Pass --draft for a real one."
        )
    return pair


def _generate(args: argparse.Namespace) -> int:
    config = _config(args)
    pair = _load(args)
    with _progress(config.max_new_tokens, "tokens") as bar:
        out = pair.generate(args.prompt, method=args.method, config=config, on_progress=bar)
    s = out.stats
    record = {
        "text": out.text,
        "method": out.method,
        "new_tokens": len(out.token_ids),
        "seconds": round(s.seconds, 3),
        "tokens_per_second": round(s.tokens_per_second, 2),
        "tokens_per_target_call": round(s.tokens_per_target_call, 3),
        "target_calls": s.target_calls,
        "draft_calls": s.draft_calls,
        "overhead_fraction": round(s.overhead_fraction, 3),
    }
    if out.method == "smcsd":
        record |= {"n_resamples": out.n_resamples, "mean_ess": out.mean_ess, "log_z": out.log_z}
    if out.acceptance is not None:
        record["acceptance"] = round(out.acceptance, 3)
    if args.json:
        print(json.dumps(record, ensure_ascii=False))
        return 0
    print(out.text if out.text else f"[empty output: {out.message}]")
    line = (
        f"[{out.method}] {record['new_tokens']} tokens in {s.seconds:.2f} s = "
        f"{s.tokens_per_second:.1f} tok/s, {s.tokens_per_target_call:.2f} tokens/target call"
    )
    if out.method == "smcsd":
        ess = f"{out.mean_ess:.2f}/{config.n_particles}"
        line += f", {out.n_resamples} resamples, mean ESS {ess}, log Z {out.log_z:.2f}"
    if out.acceptance is not None:
        line += f", acceptance {out.acceptance:.2f}"
    _err(line)
    return 0


def _speed(args: argparse.Namespace) -> int:
    from .speed import SPEED_METHODS, compare_speed

    config = _config(args)
    pair = _load(args)
    prompts = args.prompt or list(SPEED_PROMPTS)
    total = args.repeats * len(prompts) * len(SPEED_METHODS)
    with _progress(total, "runs") as bar:
        done = [0]

        def tick(_method: str) -> None:
            done[0] += 1
            bar(done[0])

        rows = compare_speed(pair, prompts, config, repeats=args.repeats, on_run=tick)
    print(
        f"{config.max_new_tokens} tokens per run, N={config.n_particles}, K={config.block_size}, "
        f"T_d={config.draft_temperature}, T_t={config.target_temperature}, {args.dtype} on {args.device}; "
        f"medians of {args.repeats} repeats x {len(prompts)} prompts"
    )
    print("| method | tokens/s | x autoregressive | tokens/target call | loop overhead |")
    print("|---|---|---|---|---|")
    for r in rows:
        ovh = "-" if r.overhead_fraction != r.overhead_fraction else f"{100 * r.overhead_fraction:.0f}%"
        print(
            f"| {r.method} | {r.tokens_per_second:.1f} | {r.speedup_vs_ar:.2f}x | "
            f"{r.tokens_per_target_call:.2f} | {ovh} |"
        )
    return 0


def _err(msg: str) -> None:
    print(msg, file=sys.stderr)


@contextmanager
def _status(msg: str):
    _err(msg + " ...")
    yield


@contextmanager
def _progress(total: int, unit: str):
    """A progress bar on stderr that appears only when work takes more than a moment."""
    from tqdm import tqdm

    with tqdm(total=total, unit=unit, delay=1.0, leave=False, file=sys.stderr) as bar:

        def update(n: int) -> None:
            bar.update(max(0, min(n, total) - bar.n))

        yield update


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``smcsd`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bar is enough
    try:
        return args.run(args)
    except ValueError as err:
        _err(f"error: {err}")
        return 2
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())

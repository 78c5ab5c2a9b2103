"""Option groups several ``smcsd`` commands share: the models, the sampling settings, grids.

This module imports no torch, so that building the parser (``smcsd --help``) stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..config import (
    DIVERGENCE_NAMES,
    FORWARDS,
    MIN_TEMPERATURE,
    PROPOSAL_NAMES,
    RESAMPLING_SCHEMES,
    SELECTIONS,
    SMCConfig,
)
from .util import cut_value, logit_bias_value, twist_value

SMC_DEFAULTS = SMCConfig()  # one set of defaults for the API and the command line


def model_args(p: argparse.ArgumentParser, *, draft: bool = True) -> None:
    """The ``models`` group: target, draft (unless ``draft=False``), dtype, threads, device, chat."""
    g = p.add_argument_group("models")
    g.add_argument(
        "--target",
        "--model",
        dest="target",
        default=None,
        help="hub id or local path (default: embedded SmolLM2-135M-Instruct)",
    )
    if draft:
        g.add_argument(
            "--draft",
            default=None,
            help="a directory made by `smcsd distill`, hub id, local path, or layers:N (default: the shipped "
            "distilled draft for the default target, else the target's first 2 layers)",
        )
        g.add_argument(
            "--draft-record",
            default="shipped",
            help="what SMC-SD's requests know of the draft before they start: shipped (default: the "
            "record a distilled draft ships, else none), none (requests probe the draft; a benchmark "
            "learns it once first), or a JSON file of passed, failed, rates and row_cost",
        )
    g.add_argument(
        "--dtype",
        default="auto",
        help="auto (default: bfloat16 where the device multiplies it natively, a GPU or a CPU with AVX-512 "
        "BF16 or AMX; else float32, which an AVX2 CPU runs faster), bfloat16, float32 or float16",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads, at most the cores (default: torch's; on a busy CPU, the cores its "
        "load leaves free)",
    )
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument(
        "--backend",
        choices=("hf", "vllm"),
        default="hf",
        help="hf: batched KV caches in PyTorch (default); vllm: both models on vLLM engines",
    )
    g.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="vLLM backend: GPUs each engine spreads over (tensor_parallel_size)",
    )
    forward_args(g)


def forward_args(g) -> None:
    """``--forward`` and ``--deterministic``: how the models compute a forward (``SMCSD(forward=...)``)."""
    g.add_argument(
        "--forward",
        choices=FORWARDS,
        default="auto",
        help="how the hf backend computes a forward: auto (default: ours for Llama-family models, its "
        "parts compiled where already built on this machine, else the model's own), compiled (ours, "
        "compiling its parts once per machine if missing), reference (transformers' own forward)",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="a seeded request gives the same tokens alone and among batch-mates: every forward it "
        "takes part in has the shapes it has alone (fixed rows and width; costs rows)",
    )


def smc_args(p: argparse.ArgumentParser, *, seed: bool = True) -> None:
    """The ``sampling`` group: every ``SMCConfig`` field, with the API's defaults (``--seed`` if ``seed``)."""
    d = SMC_DEFAULTS
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--particles", type=int, default=d.n_particles, help="N particles")
    g.add_argument(
        "-k", "--block-size", type=int, default=d.block_size, help="K, most drafted tokens per cycle"
    )
    g.add_argument(
        "--cut",
        type=cut_value,
        default=d.cut,
        help="quality floor: cut a block where D(p || q) exceeds this (adapts drafting, down to the "
        "target alone); in (0, 1] for tv, nats for renyi2 and kl; 'off' runs the paper's algorithm",
    )
    g.add_argument(
        "--cut-divergence",
        choices=DIVERGENCE_NAMES,
        default=d.cut_divergence,
        help="the divergence --cut bounds",
    )
    g.add_argument(
        "--proposal",
        choices=PROPOSAL_NAMES,
        default=d.proposal,
        help="what draws the blocks: the draft model, retrieval from the prompt and the output so far "
        "(no draft forward), their mixture, or auto (the schedule picks draft or retrieval by pass rate)",
    )
    twist_arg(g)
    g.add_argument(
        "--ess-threshold", type=float, default=d.ess_threshold, help="resample when ESS < this x N"
    )
    g.add_argument("--resampling", choices=RESAMPLING_SCHEMES, default=d.resampling, help="resampling scheme")
    g.add_argument("--draft-temperature", type=float, default=d.draft_temperature, help="T_d, at least 0.01")
    g.add_argument(
        "--target-temperature",
        type=float,
        default=d.target_temperature,
        help="T_t: 0 (greedy: the target's argmax path) or at least 0.01",
    )
    processing_args(g, d)
    g.add_argument("--alpha", type=float, default=d.alpha, help="power on the target")
    g.add_argument(
        "--selection", choices=SELECTIONS, default=d.selection, help="how the output particle is chosen"
    )
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="generation budget")
    if seed:
        g.add_argument("--seed", type=int, default=d.seed, help="seed of the run")
    g.add_argument("--ignore-eos", action="store_true", help="always emit --max-new-tokens tokens")
    g.add_argument(
        "--token-level",
        action="store_true",
        help="draft nothing: token-level SMC with the target as proposal (the baseline of SMC-SD's blocks)",
    )


def twist_arg(g) -> None:
    """``--twist``: how a constraint's future validity guides SMC-SD (off by default)."""
    g.add_argument(
        "--twist",
        type=twist_value,
        default=argparse.SUPPRESS,  # unset: SMCConfig's "auto", the constraint's own
        metavar="{future-validity,structure,finite,lookahead,off}",
        help="twist a constraint by its future validity (the chance a prefix can still be completed "
        "validly): future-validity is exact where the target can be enumerated (a mock), else "
        "lookahead, which reads one token ahead of each block; structure reads on through the finite "
        "structure there (an enum, a key, punctuation) in the same forward, a tree of up to 16 "
        "tokens per row, and tilts the next token by it; finite reads it only where every path it "
        "follows ends the output or the tree, and twists nothing where it opens into free text "
        "(default: finite with --schema, else off)",
    )


def processing_args(g, d: SMCConfig) -> None:
    """The processed target's options: top-k, top-p, min-p and a logit bias."""
    g.add_argument(
        "--top-k", type=int, default=d.top_k, help="keep the k likeliest tokens of the target (0: all)"
    )
    g.add_argument(
        "--top-p", type=float, default=d.top_p, help="keep the likeliest target tokens whose mass reaches p"
    )
    g.add_argument(
        "--min-p", type=float, default=d.min_p, help="keep target tokens at least this x as likely as the top"
    )
    g.add_argument(
        "--logit-bias",
        type=logit_bias_value,
        default=d.logit_bias,
        metavar="ID:BIAS,...",
        help="add BIAS to token ID's target logit, before the temperature",
    )


def smc_config(args: argparse.Namespace, **fixed) -> SMCConfig:
    """The ``SMCConfig`` of a command's options, then ``fixed`` fields; every command builds its own here.

    Each option named as a field sets it; ``--particles`` sets ``n_particles`` (unless it is a
    grid's list) and ``--temperature`` both temperatures. Fields without an option keep their defaults.
    """
    fields = {f.name for f in dataclasses.fields(SMCConfig)}
    values = {name: value for name, value in vars(args).items() if name in fields}
    if isinstance(getattr(args, "particles", None), int):
        values["n_particles"] = args.particles
    if getattr(args, "temperature", None) is not None:
        # Greedy (0) drafts at the lowest temperature: the draft's likeliest tokens pass most often.
        values |= {
            "draft_temperature": args.temperature or MIN_TEMPERATURE,
            "target_temperature": args.temperature,
        }
    return SMCConfig(**(values | fixed))


def constraint_args(p: argparse.ArgumentParser) -> None:
    """The ``constraint`` group: ``--schema``, ``--regex`` or ``--grammar``, one at most."""
    g = p.add_argument_group("constraint (one at most, compiled by llguidance; SMC-SD only)")
    x = g.add_mutually_exclusive_group()
    x.add_argument(
        "--schema",
        metavar="FILE|JSON",
        help="every output is JSON valid under this JSON Schema: a file, or the schema's own text",
    )
    x.add_argument(
        "--regex", metavar="PATTERN", help="every output matches this regex in full (Python syntax)"
    )
    x.add_argument(
        "--grammar",
        metavar="FILE.lark",
        help="every output is a sentence of this grammar (llguidance's Lark dialect; rule `start`)",
    )


def read_constraint(args: argparse.Namespace):
    """The ``ConstraintSpec`` the constraint options name (None: none), files read and JSON parsed."""
    from pathlib import Path

    from ..potentials.spec import ConstraintSpec

    if args.schema is not None:
        flag, kind, value = "--schema", "schema", args.schema
        text = (
            value
            if value.lstrip().startswith("{")
            else _read_text(value, flag, "a JSON Schema file, or the schema's JSON text")
        )
    elif args.regex is not None:
        flag, kind, text = "--regex", "regex", args.regex
    elif args.grammar is not None:
        flag, kind, text = (
            "--grammar",
            "grammar",
            _read_text(args.grammar, "--grammar", "a Lark grammar file"),
        )
    else:
        return None
    if getattr(args, "method", "smcsd") != "smcsd":
        raise ValueError(f"{flag} runs with --method smcsd only, got --method {args.method}")
    try:
        return ConstraintSpec(kind, text)
    except ValueError as err:
        where = "" if kind != "schema" or text is value else f" {Path(value)}"
        raise ValueError(f"{flag}{where}: {err}") from err


def _read_text(path: str, flag: str, what: str) -> str:
    """A UTF-8 file's text, or one line saying why it cannot be read."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{flag} {path}: no such file (give {what})")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte {err.start})") from err


def prompt_args(p: argparse.ArgumentParser, *, per_category: int | None) -> None:
    """How many of a dataset's prompts to use: ``--limit`` and ``--per-category``."""
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    p.add_argument(
        "--per-category", type=int, default=per_category, help="at most this many prompts per category"
    )


def grid_args(p: argparse.ArgumentParser, *, particles: str, block_sizes: str) -> None:
    """The N and K axes of a grid: ``--particles`` and ``--block-sizes``, comma-separated."""
    p.add_argument("--particles", default=particles, help="comma-separated N values")
    p.add_argument("--block-sizes", default=block_sizes, help="comma-separated K values")


def command(sub, name: str, help: str, *, draft: bool = True, **kwargs) -> argparse.ArgumentParser:
    """A subcommand that loads models: its parser, with the ``models`` group already added."""
    parser = sub.add_parser(name, help=help, **kwargs)
    model_args(parser, draft=draft)
    return parser

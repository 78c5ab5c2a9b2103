"""``smcsd distill``: make a draft for a target (``eval_draft`` measures it)."""

from __future__ import annotations

import argparse
import pathlib

from ..config import DIVERGENCE_NAMES
from .loading import load_target
from .options import SMC_DEFAULTS, command
from .util import check_output_dir, csv, cut_value, err, progress


def add_parsers(sub) -> None:
    """Add the ``distill`` subcommand to the ``smcsd`` parser."""
    dist = command(
        sub,
        "distill",
        "train a small draft for a target on the target's own outputs (resumable)",
        draft=False,
        description="Collect the target's continuations of prompts (with its top-k next-token "
        "log-probs), then train a draft sharing the target's embeddings and LM head: a few of its "
        "layers, which may also read its hidden states (--kind features). "
        "Every stage resumes where an interrupted run stopped. The draft lands in OUT/draft.",
    )
    dist.add_argument("--out", required=True, help="run directory (data, checkpoint, log, draft)")
    prompt_args(dist, "training prompts: 'builtin' (a general instruction set) or")
    dist.add_argument("--limit", type=int, default=None, help="at most this many prompts from each file")
    dist.add_argument(
        "--corpus", action="append", default=[], help="plain-text file to train on too (repeatable)"
    )
    dist.add_argument(
        "--eval-prompts", default=None, help="held-out prompts for the training curve (optional)"
    )
    dist.add_argument("--eval-categories", default=None, help="categories of --eval-prompts to use")
    dist.add_argument("--eval-limit", type=int, default=48, help="held-out prompts used (default 48)")
    _data_args(dist.add_argument_group("data"))
    _training_args(dist.add_argument_group("training"))
    dist.set_defaults(run=_distill)


def _data_args(g) -> None:
    g.add_argument(
        "--max-prompts",
        type=int,
        default=None,
        help="use at most this many prompts (after mixing the sources)",
    )
    g.add_argument("--gen-tokens", type=int, default=128, help="target tokens per prompt (default 128)")
    g.add_argument(
        "--sample-temperature",
        type=float,
        default=0.7,
        help="temperature of the target's answers (default 0.7)",
    )
    g.add_argument("--max-prompt-tokens", type=int, default=192, help="prompt tail kept per example")
    g.add_argument("--top-k", type=int, default=64, help="target log-probs kept per position (default 64)")
    g.add_argument("--gen-batch", type=int, default=32, help="prompts per generation batch (default 32)")


def _training_args(g) -> None:
    g.add_argument(
        "--kind",
        choices=("layers", "features"),
        default="layers",
        help="'layers': a stack of the target's first layers; "
        "'features': the same, also reading the target's hidden states (EAGLE-style)",
    )
    g.add_argument(
        "--init-draft",
        default=None,
        help="start from this trained layer draft, e.g. to fine-tune it on another --objective "
        "(a feature draft first ignores the states)",
    )
    g.add_argument("--unroll", type=int, default=2, help="feature drafts: passes fed their own states")
    g.add_argument("--state-weight", type=float, default=0.5, help="feature drafts: state regression weight")
    g.add_argument("--layers", type=int, default=4, help="draft layers, from the target's first ones")
    g.add_argument("--source-layers", default=None, help="comma-separated target layers to start from")
    g.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    g.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per step (default 4096)")
    g.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    g.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (default 50)")
    g.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    g.add_argument("--no-bf16", action="store_true", help="train in float32 (default: bf16 autocast)")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompt shuffle, sampling and training")
    _objective_args(g)


def _objective_args(g) -> None:
    g.add_argument(
        "--objective",
        choices=("kl", "chi2", "renyi2"),
        default="kl",
        help="kl: cross-entropy against the target's top-k (default); chi2: the variance of SMC-SD's "
        "weights where the quality cut keeps drafted tokens, their Renyi-2 where it cuts; renyi2: the "
        "weights' log second moment everywhere (docs/distill.md)",
    )
    g.add_argument(
        "--objective-temperature",
        type=float,
        default=1.0,
        help="chi2, renyi2: T of both models: the temperature SMC-SD will sample at (default: %(default)s)",
    )
    g.add_argument(
        "--cut",
        type=cut_value,
        default=SMC_DEFAULTS.cut,
        help=f"chi2: the quality cut the draft will run under (default {SMC_DEFAULTS.cut}; 'off': none)",
    )
    g.add_argument(
        "--cut-divergence",
        choices=DIVERGENCE_NAMES,
        default=SMC_DEFAULTS.cut_divergence,
        help="chi2: the divergence --cut bounds",
    )


def prompt_args(p: argparse.ArgumentParser, what: str, *, required: bool = True) -> None:
    """``--prompts`` (``what`` they are) and ``--categories``."""
    p.add_argument(
        "--prompts",
        action="append",
        required=required,
        help=f"{what} a JSONL file (Spec-Bench, GSM8K, 'prompt' records); repeatable",
    )
    p.add_argument("--categories", default=None, help="comma-separated categories of the files to use")


def prompt_texts(sources: list[str], categories: str | None, limit: int | None) -> list[str]:
    """Prompt texts of every source; ``limit`` cuts each file (not the builtin set)."""
    from ..batch.prompts import load_prompts
    from ..distill import builtin_prompts

    keep = {c.strip() for c in categories.split(",")} if categories else None
    texts: list[str] = []
    for source in sources:
        if source == "builtin":
            texts += builtin_prompts()
            continue
        chosen = [p.text for p in load_prompts(source) if keep is None or p.category in keep]
        if not chosen:
            raise ValueError(f"no prompts of categories {sorted(keep or [])} in {source!r}")
        texts += chosen[:limit]
    return texts


def _distill(args: argparse.Namespace) -> int:
    import random

    from ..distill import load_examples

    config = _distill_config(args)
    texts = prompt_texts(args.prompts, args.categories, args.limit)
    random.Random(args.seed).shuffle(texts)  # shards then mix sources evenly
    texts = texts[: args.max_prompts]
    check_output_dir(args.out, "--out")
    target = load_target(args)
    out = pathlib.Path(args.out)
    train_dirs, held_out = _collect_data(args, target, texts, out)
    draft_dir = _train(target, load_examples(*train_dirs), out, config, held_out)
    from ..distill.overlap import record_training_prompts

    record_training_prompts(draft_dir, texts)  # so that eval-draft can tell held-out prompts apart
    from ..distill.evaluate import plot_curve

    if plot_curve(out / "train_log.jsonl", out / "curve.png"):
        print(f"training curve (held-out agreement and acceptance vs tokens): {out / 'curve.png'}")
    print(f"draft written to {draft_dir}; use it with: smcsd generate --draft {draft_dir} PROMPT")
    return 0


def _distill_config(args: argparse.Namespace):
    from ..distill import DistillConfig

    source_layers = tuple(csv(args.source_layers, int, "--source-layers")) if args.source_layers else None
    return DistillConfig(
        kind=args.kind,
        init_draft=args.init_draft,
        unroll=args.unroll,
        state_weight=args.state_weight,
        layers=len(source_layers) if source_layers else args.layers,
        source_layers=source_layers,
        steps=args.steps,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        save_every=args.save_every,
        eval_every=args.eval_every,
        bf16=not args.no_bf16,
        seed=args.seed,
        objective=args.objective,
        objective_temperature=args.objective_temperature,
        cut=args.cut,
        cut_divergence=args.cut_divergence,
    )


def _collect_data(args: argparse.Namespace, target, texts: list[str], out: pathlib.Path):
    """The target's answers to ``texts`` and its top-k on each ``--corpus`` file, and held-out examples.

    Returns the training data's directories and the held-out examples (empty without --eval-prompts).
    """
    from ..distill import CollectSettings, collect, corpus_examples, load_examples
    from ..models import eos_ids
    from ..text import encode_prompt

    tok, chat = target.tokenizer, not args.no_chat
    common = dict(max_prompt_tokens=args.max_prompt_tokens, top_k=args.top_k, seed=args.seed)
    stops = eos_ids(target)  # as generation stops: the generation config's too

    def answers(texts: list[str], where: str, unit: str, **kw) -> None:
        with progress(len(texts), unit) as bar:
            prompts = [encode_prompt(tok, t, chat=chat) for t in texts]
            collect(
                target.model,
                prompts,
                out / "data" / where,
                eos_ids=stops,
                settings=CollectSettings(**kw, **common),
                on_progress=lambda done, _: bar(done),
            )

    err(f"collecting the target's answers to {len(texts)} prompts in {out / 'data'}")
    gen = dict(max_new_tokens=args.gen_tokens, temperature=args.sample_temperature, batch_size=args.gen_batch)
    answers(texts, "train", "prompts", **gen)
    dirs = [out / "data" / "train"]
    for n, path in enumerate(args.corpus):
        text = pathlib.Path(path).read_text(encoding="utf-8")
        dirs.append(
            corpus_examples(target.model, [text], tok, out / "data" / f"corpus-{n}", top_k=args.top_k)
        )
    if not args.eval_prompts:
        return dirs, []
    eval_texts = prompt_texts([args.eval_prompts], args.eval_categories, None)[: args.eval_limit]
    answers(eval_texts, "eval", "held-out prompts", max_new_tokens=64, temperature=None, batch_size=16)
    return dirs, load_examples(out / "data" / "eval")


def _train(target, train: list, out: pathlib.Path, config, held_out: list) -> pathlib.Path:
    """Train the draft with a progress bar and a line per held-out evaluation; returns its directory."""
    from ..distill import distill

    tokens = sum(len(e.ids) for e in train)
    shape = "feature" if config.kind == "features" else f"{config.layers}-layer"
    err(f"training a {shape} draft on {tokens} tokens for {config.steps} steps")
    if config.kind == "features":
        err("first, one target forward over the data for its hidden states")
    with progress(config.steps, "steps") as bar:

        def tick(p) -> None:
            bar(p.step)
            if p.metrics:
                err(
                    f"step {p.step}: loss {p.loss:.3f}, held-out agreement {p.metrics['agreement']:.3f}, "
                    f"acceptance(T=1) {p.metrics['acceptance_T1']:.3f} after {p.tokens} tokens"
                )

        return distill(target, train, out, config, held_out=held_out, on_progress=tick)

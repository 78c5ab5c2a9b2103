"""``smcsd distill`` and ``smcsd eval-draft``: make a draft for a target and measure it."""

from __future__ import annotations

import argparse
import json
import pathlib

from ..config import DIVERGENCE_NAMES
from .loading import load_pair, load_target
from .options import SMC_DEFAULTS, command, smc_args, smc_config
from .util import check_output_dir, check_threads, csv, cut_value, err, progress


def add_parsers(sub) -> None:
    """Add the ``distill`` and ``eval-draft`` subcommands to the ``smcsd`` parser."""
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
    _prompt_args(dist, "training prompts: 'builtin' (a general instruction set) or")
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
    _add_eval_draft(sub)


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


def _add_eval_draft(sub) -> None:
    ev = command(
        sub,
        "eval-draft",
        "agreement, acceptance, what SMC-SD does with a draft, and its forward cost",
        description="Measure a draft against its target on held-out prompts: on the target's greedy "
        "continuations (--max-new-tokens each), how often the draft agrees, passes the quality cut and "
        "would be accepted; then SMC-SD with the sampling settings below (the draft proposing, each "
        "request on its own): tokens per target call, ESS and what the schedule chose; and the cost "
        "of a draft forward.",
    )
    _prompt_args(
        ev,
        "held-out prompts (default: short_answer, the built-in short-answer task): short_answer, "
        "'builtin' (the instruction set the shipped draft was TRAINED on: not held out) or",
        required=False,
    )
    ev.add_argument("--limit", type=int, default=None, help="at most this many prompts in all")
    ev.add_argument("--no-smc", action="store_true", help="skip the SMC-SD runs")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    smc_args(ev)
    # the target's greedy tokens and SMC-SD's budget; the draft, not retrieval, proposes
    ev.set_defaults(run=_eval_draft, max_new_tokens=64, proposal="draft")


def _prompt_args(p: argparse.ArgumentParser, what: str, *, required: bool = True) -> None:
    p.add_argument(
        "--prompts",
        action="append",
        required=required,
        help=f"{what} a JSONL file (Spec-Bench, GSM8K, 'prompt' records); repeatable",
    )
    p.add_argument("--categories", default=None, help="comma-separated categories of the files to use")


def _texts(sources: list[str], categories: str | None, limit: int | None) -> list[str]:
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
    texts = _texts(args.prompts, args.categories, args.limit)
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
    from ..distill import collect, corpus_examples, load_examples
    from ..models import eos_ids
    from ..text import encode_prompt

    tok, chat = target.tokenizer, not args.no_chat
    common = dict(max_prompt_tokens=args.max_prompt_tokens, top_k=args.top_k, seed=args.seed)
    common["eos_ids"] = eos_ids(target)  # as generation stops: the generation config's too

    def answers(texts: list[str], where: str, unit: str, **kw) -> None:
        with progress(len(texts), unit) as bar:
            prompts = [encode_prompt(tok, t, chat=chat) for t in texts]
            collect(target.model, prompts, out / "data" / where, on_progress=lambda done, _: bar(done), **kw)

    err(f"collecting the target's answers to {len(texts)} prompts in {out / 'data'}")
    gen = dict(max_new_tokens=args.gen_tokens, temperature=args.sample_temperature, batch_size=args.gen_batch)
    answers(texts, "train", "prompts", **gen, **common)
    dirs = [out / "data" / "train"]
    for n, path in enumerate(args.corpus):
        text = pathlib.Path(path).read_text(encoding="utf-8")
        dirs.append(
            corpus_examples(target.model, [text], tok, out / "data" / f"corpus-{n}", top_k=args.top_k)
        )
    if not args.eval_prompts:
        return dirs, []
    eval_texts = _texts([args.eval_prompts], args.eval_categories, None)[: args.eval_limit]
    answers(
        eval_texts, "eval", "held-out prompts", max_new_tokens=64, temperature=None, batch_size=16, **common
    )
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


def _eval_draft(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    config = None if args.no_smc else smc_config(args)  # bad settings fail before any loading
    texts = _texts(args.prompts or ["short_answer"], args.categories, None)[: args.limit]
    check_threads(args.threads)
    pair = load_pair(args, torch_models=True)
    _warn_overlap(args.draft, pair, texts)
    # the pass rate on the greedy tokens reads the TV cut SMC-SD runs with (the default's otherwise)
    tv = args.cut if args.cut is not None and args.cut_divergence == "tv" else SMC_DEFAULTS.cut
    result = _measure_draft(pair, texts, args.max_new_tokens, config, tv)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"draft {result['draft']} vs target {result['target']}: {len(texts)} prompts, "
        f"{result['positions']} greedy target tokens"
    )
    print(
        "| agreement (top-1) | acceptance prob. T=1 | acceptance prob. T=0.7 | pass rate T=1 "
        "| pass rate T=0.7 | draft 8 rows | target 1 row | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {result['agreement']:.3f} | {result['acceptance_T1']:.3f} | {result['acceptance_T0.7']:.3f} | "
        f"{result['pass_T1']:.3f} | {result['pass_T0.7']:.3f} | {result['cost_draft_ms']:.1f} ms | "
        f"{result['cost_target_ms']:.1f} ms | {result['cost_ratio']:.2f} |"
    )
    err(
        "agreement: share of positions where the draft's top token is the target's; acceptance prob.: "
        "the mean per-position probability that speculative sampling accepts a drafted token; pass "
        f"rate: share of positions the quality cut (TV <= {tv}) keeps"
    )
    if config is not None:
        _print_smc(result, config)
    return 0


def _print_smc(result: dict, config) -> None:
    """The SMC-SD half of ``eval-draft``'s report."""

    def num(key: str, spec: str = ".3f") -> str:
        return "-" if result[key] is None else format(result[key], spec)

    print(
        f"SMC-SD, N={config.n_particles}, K={config.block_size}, cut {config.cut}, proposal "
        f"{config.proposal}, T_d={config.draft_temperature}, T_t={config.target_temperature}, "
        f"{result['smc_cycles']} cycles:"
    )
    print(
        "| tokens / target call | ESS / N | cycles with the target alone | mean draft length "
        "| draft pass rate |"
    )
    print("|---|---|---|---|---|")
    print(
        f"| {num('smc_tokens_per_target_call', '.2f')} | {num('smc_ess_fraction')} | "
        f"{num('smc_target_alone')} | {num('smc_draft_length', '.2f')} | {num('smc_pass_rate')} |"
    )
    err(
        "ESS / N: over the cycles that ran two particles or more; mean draft length: over the cycles "
        "that drafted; draft pass rate: kept drafted positions / (kept + cuts), what the schedule reads"
    )


def _measure_draft(pair, texts: list[str], max_new_tokens: int, config, tv_cut: float) -> dict:
    from ..distill import forward_cost, match_metrics, smc_metrics
    from ..distill.data import greedy_examples

    prompts = [pair.encode(t) for t in texts]
    target, draft = pair.target.model, pair.draft.model
    # Model work on the pair's torch thread, as its calls run: one OpenMP team in the process.
    with progress(len(prompts), "prompts") as bar:
        examples = pair.call(
            lambda: greedy_examples(
                target, prompts, eos_ids=pair.eos_token_ids, max_new_tokens=max_new_tokens, on_progress=bar
            )
        )
    result = {"prompts": len(texts), "draft": pair.draft.name, "target": pair.target.name}
    result |= pair.call(lambda: match_metrics(target, draft, examples, cut=tv_cut)) | {"pass_cut": tv_cut}
    if config is not None:
        with progress(len(texts), "SMC-SD runs") as bar:
            result |= smc_metrics(pair, texts, config, on_progress=bar)
    result |= {f"cost_{k}": v for k, v in pair.call(lambda: forward_cost(target, draft)).items()}
    return result


def _warn_overlap(spec: str | None, pair, texts: list[str]) -> None:
    """Warn when the prompts are among the ones the draft was trained on."""
    from ..distill.overlap import training_overlap
    from ..models.drafts import SHIPPED_DRAFT, is_draft_dir

    if spec is None:
        draft_dir = SHIPPED_DRAFT if pair.draft.name == "default distilled draft" else None
    else:
        draft_dir = pathlib.Path(spec).expanduser() if is_draft_dir(pathlib.Path(spec).expanduser()) else None
    seen = None if draft_dir is None else training_overlap(draft_dir, texts)
    if seen:
        err(
            f"warning: {seen} of these {len(texts)} prompts are in the draft's training data, where it "
            "agrees with the target far more often than on held-out prompts; measure on held-out ones "
            "(the default, short_answer, is)"
        )

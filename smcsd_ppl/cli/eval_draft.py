"""``smcsd eval-draft``: measure a draft against its target, and save what SMC-SD learned of it."""

from __future__ import annotations

import argparse
import json
import pathlib

from ..config import DraftRecord
from .distill import prompt_args, prompt_texts
from .loading import load_pair
from .options import SMC_DEFAULTS, command, smc_args, smc_config
from .util import check_threads, err, progress

NOT_DISTILLED = "--save-record writes a distilled draft's manifest; this draft is not one"


def add_parser(sub) -> None:
    """Add the ``eval-draft`` subcommand to the ``smcsd`` parser."""
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
    prompt_args(
        ev,
        "held-out prompts (default: short_answer, the built-in short-answer task): short_answer, "
        "'builtin' (the instruction set the shipped draft was TRAINED on: not held out) or",
        required=False,
    )
    ev.add_argument("--limit", type=int, default=None, help="at most this many prompts in all")
    ev.add_argument("--no-smc", action="store_true", help="skip the SMC-SD runs")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.add_argument(
        "--save-record",
        action="store_true",
        help="write what SMC-SD learned of the draft (its pass rate, at this machine's row cost) into "
        "the distilled draft's manifest: the record its requests start from, instead of probing it",
    )
    smc_args(ev)
    # the target's greedy tokens and SMC-SD's budget; the draft, not retrieval, proposes
    ev.set_defaults(run=_eval_draft, max_new_tokens=64, proposal="draft")


def _eval_draft(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    config = None if args.no_smc else smc_config(args)  # bad settings fail before any loading
    texts = prompt_texts(args.prompts or ["short_answer"], args.categories, None)[: args.limit]
    if args.save_record and args.no_smc:
        raise ValueError("--save-record saves what the SMC-SD runs learn; drop --no-smc")
    if args.save_record and args.draft is not None and _draft_dir(args.draft, None) is None:
        raise ValueError(NOT_DISTILLED)  # before loading anything
    check_threads(args.threads)
    pair = load_pair(args, torch_models=True)
    draft_dir = _draft_dir(args.draft, pair)
    if args.save_record and draft_dir is None:
        raise ValueError(NOT_DISTILLED)
    pair.draft_record = DraftRecord()  # the draft measured from nothing, not from its shipped record
    _warn_overlap(draft_dir, pair, texts)
    # the pass rate on the greedy tokens reads the TV cut SMC-SD runs with (the default's otherwise)
    tv = args.cut if args.cut is not None and args.cut_divergence == "tv" else SMC_DEFAULTS.cut
    result = _measure_draft(pair, texts, args.max_new_tokens, config, tv)
    if args.save_record:
        _save_record(
            draft_dir, pair, result, config, f"{len(texts)} of {', '.join(args.prompts or ['short_answer'])}"
        )
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


def _draft_dir(spec: str | None, pair) -> pathlib.Path | None:
    """The directory of the pair's distilled draft (None for any other draft)."""
    from ..models.drafts import SHIPPED_DRAFT, is_draft_dir

    if spec is None:
        return SHIPPED_DRAFT if pair.draft.name == "default distilled draft" else None
    return pathlib.Path(spec).expanduser() if is_draft_dir(pathlib.Path(spec).expanduser()) else None


def _save_record(draft_dir: pathlib.Path, pair, result: dict, config, prompts: str) -> None:
    """Write the SMC-SD runs' pooled evidence into the draft's manifest, at this machine's row cost."""
    from ..inference.schedule import row_position_cost
    from ..models.drafts import save_record

    lm = pair.target_lm
    row_cost = row_position_cost(lm.device.type, getattr(lm, "row_position_cost", None))
    record = DraftRecord(result["smc_passed"], result["smc_failed"], row_cost=row_cost)
    measured = {
        "prompts": prompts,
        "device": str(lm.device),
        "dtype": str(pair.target.model.dtype).removeprefix("torch."),
        "settings": {
            k: getattr(config, k)
            for k in (
                "n_particles",
                "block_size",
                "cut",
                "draft_temperature",
                "target_temperature",
                "max_new_tokens",
            )
        },
    }
    save_record(draft_dir, record, measured)
    err(f"saved the draft record {record.as_json()} to {draft_dir}")


def _warn_overlap(draft_dir: pathlib.Path | None, pair, texts: list[str]) -> None:
    """Warn when the prompts are among the ones the draft was trained on."""
    from ..distill.overlap import training_overlap

    seen = None if draft_dir is None else training_overlap(draft_dir, texts)
    if seen:
        err(
            f"warning: {seen} of these {len(texts)} prompts are in the draft's training data, where it "
            "agrees with the target far more often than on held-out prompts; measure on held-out ones "
            "(the default, short_answer, is)"
        )

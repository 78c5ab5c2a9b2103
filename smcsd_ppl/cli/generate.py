"""``smcsd generate``: one prompt's output, streamed as SMC-SD settles it, with one line of statistics."""

from __future__ import annotations

import argparse
import json
import sys
import threading

from ..names import METHOD_SUMMARIES
from .loading import check_before_loading, load_pair
from .options import (
    constraint_args,
    model_args,
    read_constraint,
    smc_args,
    smc_config,
)
from .util import check_threads, err, progress, read_prompt

_WRITING = threading.Lock()  # the streamed text is written on the torch thread; Ctrl-C closes it here


def add_parser(sub) -> None:
    """Add ``generate`` to the ``smcsd`` parser."""
    gen = sub.add_parser(
        "generate",
        help="generate a continuation of a prompt",
        description="SMC-SD prints the text as it is settled (what every surviving particle shares, "
        "which the output extends); Ctrl-C keeps it. The other methods print the text at the end.",
    )
    gen.add_argument(
        "prompt", help="the prompt (wrapped in the chat template of instruct models); - reads standard input"
    )
    gen.add_argument(
        "--method",
        choices=list(METHOD_SUMMARIES),
        default="smcsd",
        help="; ".join(f"{name}: {summary}" for name, summary in METHOD_SUMMARIES.items()),
    )
    model_args(gen)
    smc_args(gen)
    constraint_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.add_argument(
        "--quiet",
        action="store_true",
        help="nothing on standard error but errors (no loading lines, no statistics)",
    )
    gen.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Generate, print the text (streamed for SMC-SD) and the statistics; 130 on Ctrl-C."""
    check_threads(args.threads)
    wanted = read_constraint(args)
    config = smc_config(args)
    prompt = read_prompt(args.prompt)
    from ..methods.registry import get as get_method  # imports torch: after the checks that need none
    from ..text import TextStream

    check_before_loading(args, [prompt], config, get_method(args.method).uses_draft)
    pair = load_pair(args)
    constraint = None if wanted is None else wanted.build(pair.tokenizer, pair.eos_token_ids)
    stream = None if args.json or args.method != "smcsd" else TextStream(pair.core.decode_bytes)
    try:
        out = _generate(pair, prompt, config, args.method, constraint, stream)
    except KeyboardInterrupt:
        if stream is None or not stream.text:
            raise
        with _WRITING:
            stream.close()
        print(flush=True)
        err(
            f"interrupted after {stream.tokens} settled tokens: the text above is where every surviving "
            "particle agreed; generation stopped there"
        )
        return 130
    if args.json:
        print(json.dumps(out.to_record(), ensure_ascii=False))
        return 0
    _print_text(out, "" if stream is None else stream.text)
    _print_stats(out, config)
    return 0


def _generate(pair, prompt: str, config, method: str, constraint, stream):
    """The ``Generation``; a progress bar unless the text itself streams to standard output."""
    from ..batch.run import generate_one

    if stream is None:
        with progress(config.max_new_tokens, "tokens") as bar:
            return generate_one(pair, prompt, config, method=method, constraint=constraint, on_tokens=bar)

    def show(ids: tuple[int, ...]) -> None:
        with _WRITING:
            new = stream.update(ids)
            if new:
                sys.stdout.write(new)
                sys.stdout.flush()

    return generate_one(pair, prompt, config, method=method, constraint=constraint, on_settled=show)


def _print_text(out, shown: str) -> None:
    """What of the output was not streamed yet, or all of it; a note where it is empty or incomplete."""
    if out.text.startswith(shown):
        rest = out.text[len(shown) :]
        print(rest if out.text else f"[empty output: {out.message}]", flush=True)
    else:  # every particle died after a prefix was shown
        print(flush=True)
        err(f"note: the output does not extend the text shown above; it is {out.text or 'empty'!r}")
    if out.text and out.message:
        err(f"note: {out.message}")


def _print_stats(out, config) -> None:
    """One line of statistics on stderr, and a warning where the particles collapsed."""
    s, smc, spec = out.stats, out.smc, out.speculative
    line = (
        f"[{out.method}] {len(out.token_ids)} tokens in {s.seconds:.2f} s = "
        f"{s.tokens_per_second:.1f} tok/s, {s.tokens_per_target_call:.2f} tokens/target call"
    )
    if smc is not None:
        ess = f"{smc.mean_ess:.2f}/{config.n_particles}"
        line += f", {smc.n_resamples} resamples, {_ess(smc, ess)}, log Z {smc.log_z:.2f}"
        line += _drafting(smc.draft_lengths, smc.proposals)
    if spec is not None:
        line += f", acceptance (accepted/drafted tokens) {spec.acceptance:.2f}"
    err(line)
    if smc is not None and smc.collapsed:
        err(
            f"warning: the draft is too far from the target at these settings (mean ESS {ess}): the "
            "output follows the draft more than the target; use --cut 0.3, a smaller --block-size, "
            "more --particles or a closer --draft"
        )


def _ess(smc, ess: str) -> str:
    """The mean ESS and what it averages: cycles of N particles, not those decoding alone with one."""
    alone = sum(n == 1 for n in smc.particle_trace)
    several = len(smc.particle_trace) - alone
    if not several:
        return f"one particle throughout ({alone} cycles)" if alone else "no cycle"
    tail = f"; {alone} more with one particle" if alone else ""
    return f"mean ESS {ess} over {several} cycle(s){tail}"


def _drafting(lengths: list[int], proposals: list[str]) -> str:
    """How the quality cut's schedule proposed, in a few words ('' for the paper's algorithm)."""
    if not lengths:
        return ""
    if not any(lengths):
        return ", target alone (the draft does not pay here)"
    used = [(n, kind) for n, kind in zip(lengths, proposals) if n]
    kinds = ", ".join(
        f"{sum(k == kind for _, k in used)} {kind}" for kind in dict.fromkeys(k for _, k in used)
    )
    blocks = f"blocks of {min(n for n, _ in used)}-{max(n for n, _ in used)} tokens ({kinds})"
    if lengths[-1] == 0:
        return f", target alone besides {len(used)} cycle(s) that proposed {blocks}"
    return f", proposed {blocks}"

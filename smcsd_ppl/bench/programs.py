"""Your own program under SMC-SD's blocks and under token-level SMC, on the same target.

Token-level SMC is the same program with nothing drafted (``SMCConfig.token_level``): every
block is one token drawn from the target, with its weight, which is what LLaMPPL and
genlm-control run. Both use the same particles, conditions, twists and constraints, so the
rows differ only in how tokens are proposed; quality (valid outputs, the target's log p per
token, log Z, ESS) sits beside speed.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from ..api import SMCSD
from ..config import SMCConfig
from ..inference.program import SMCSDModel
from .quality import target_loglik_per_token

MODES = ("token-level", "blocks")


@dataclass
class ProgramRow:
    """One way of running the program, summarized over repeats (medians; ``valid``: a share)."""

    mode: str
    runs: int
    valid: float  # share of runs that returned an output (some particle alive)
    tokens_per_second: float
    tokens: float
    target_calls: float
    loglik_per_token: float
    log_z: float
    mean_ess: float
    example: str


def compare_program(
    pair: SMCSD,
    make_program: Callable[[], SMCSDModel],
    config: SMCConfig,
    *,
    repeats: int = 3,
    on_run: Callable[[str], None] | None = None,
) -> list[ProgramRow]:
    """Run the program ``repeats`` times each way, interleaved, with the same seeds and N."""
    ways = {mode: (make_program, mode == "token-level") for mode in MODES}
    return [row_of(mode, recs) for mode, recs in run_ways(pair, ways, config, repeats, on_run).items()]


def run_ways(pair: SMCSD, ways: dict, config: SMCConfig, repeats: int, on_run=None) -> dict[str, list]:
    """Each way's (result, target log p per token) of every repeat, the ways interleaved, same seeds.

    ``ways``: name -> (program factory, whether it runs token-level).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs: dict[str, list] = {name: [] for name in ways}
    for rep in range(repeats):
        for name, (make_program, token_level) in ways.items():
            cfg = dataclasses.replace(config, seed=config.seed + rep, token_level=token_level)
            program = make_program()
            [out] = pair.run([program], cfg)
            prompt = program.main_context.prompt
            prompt_ids = pair.encode(prompt) if isinstance(prompt, str) else list(prompt)
            runs[name].append((out, target_loglik_per_token(pair, prompt_ids, out.token_ids)))
            if on_run is not None:
                on_run(name)
    return runs


def _median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def row_of(mode: str, recs: list) -> ProgramRow:
    """One way's row from its records (medians; ``valid``: a share)."""
    outs = [out for out, _ in recs]
    return ProgramRow(
        mode,
        len(recs),
        sum(bool(o.token_ids) for o in outs) / len(outs),
        _median(o.stats.tokens_per_second for o in outs),
        _median(len(o.token_ids) for o in outs),
        _median(o.stats.target_calls for o in outs),
        _median(ll for _, ll in recs),
        _median(o.smc.log_z for o in outs),
        _median(o.smc.mean_ess for o in outs),
        outs[0].text,
    )


def summary(rows: list[ProgramRow]) -> str:
    """Quality beside speed in one line; the speed ratio only when both ways returned outputs."""
    by = {r.mode: r for r in rows}
    blocks, token = by["blocks"], by["token-level"]
    line = "; ".join(
        f"{r.mode}: {r.valid:.0%} valid, log p/tok {r.loglik_per_token:.2f}, log Z {r.log_z:.2f}"
        for r in (blocks, token)
    )
    if blocks.runs < 2:
        return line + "; speed ratio: needs 2 repeats or more"
    if not (blocks.valid and token.valid and token.tokens_per_second):
        return line + "; no speed ratio: one way returned no output"
    return line + f"; blocks run at {blocks.tokens_per_second / token.tokens_per_second:.2f}x token-level"

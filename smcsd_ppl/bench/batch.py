"""Batches of prompts with full outputs: one JSONL record per prompt, resumable.

Each prompt runs alone with a seed made from the base seed and the prompt's id, so a record
depends on its prompt, the settings and that seed only: never on the prompts before it, how
the file was split across runs, or the order prompts were read in. The file's records carry
the run's settings, and a file made under others is refused rather than extended.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import methods as registry
from ..config import SMCConfig
from ..inference.program import SMCSDModel
from ..inference.state import StepInfo
from ..results import Generation
from .harness import (
    append_record,
    appending,
    check_compatible,
    existing_records,
    prompt_digest,
    record_seed,
    run_settings,
)
from .prompt import Prompt

if TYPE_CHECKING:
    from ..api import SMCSD
    from ..potentials.spec import ConstraintSpec

BATCH_KEY = ("prompt_id",)
WRITER = "smcsd batch"

OnRecord = Callable[[dict, int, int], None]


def generate_one(
    pair: SMCSD,
    prompt: str,
    config: SMCConfig,
    *,
    method: str = "smcsd",
    constraint=None,
    on_tokens: Callable[[int], None] | None = None,
    on_settled: Callable[[tuple[int, ...]], None] | None = None,
) -> Generation:
    """One prompt's output; under a constraint, or streamed, SMC-SD's default program runs it.

    Args:
        pair: the models.
        prompt: the prompt's text.
        config: the settings, seed included.
        method: a method name; ``"smcsd"`` under a constraint.
        constraint: a built ``Constraint`` (``ConstraintSpec.build``), or None.
        on_tokens: called with the length of the longest particle so far.
        on_settled: SMC-SD only (never called by other methods): after each cycle, the tokens
            every surviving particle shares, which the output will extend.
    """
    if constraint is None and (on_settled is None or method != "smcsd"):
        return pair.generate(prompt, method=method, config=config, on_progress=on_tokens)
    if method != "smcsd":
        raise ValueError(f"a constraint runs with the smcsd method only, got {method!r}")
    pair.check_fits([pair.encode(prompt)], config, registry.get(method))

    def hook(info: StepInfo) -> None:
        if on_tokens is not None:
            on_tokens(info.tokens)
        if on_settled is not None and info.populations:
            on_settled(info.settled(0))

    [out] = pair.run([SMCSDModel(prompt, constraint)], config, on_cycle=hook)
    return out


def batch_settings(pair: SMCSD, config: SMCConfig, method: str, constraint: ConstraintSpec | None) -> dict:
    """Every setting that changes a batch's records (the threads aside: they change only timings)."""
    settings = run_settings(pair, config)
    del settings["threads"]
    return settings | settings_before_loading(config, method, constraint)


def settings_before_loading(config: SMCConfig, method: str, constraint: ConstraintSpec | None) -> dict:
    """The settings of a batch known before any model loads: all but the models' own."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "seed"}
    return (
        {"base_seed": config.seed}
        | fields
        | {
            "method": method,
            "constraint": None if constraint is None else constraint.kind,
            "constraint_sha": None if constraint is None else constraint.digest(),
        }
    )


@dataclass
class BatchSummary:
    """What a batch holds once it has run: its records, and how many were resumed, failed, cut short."""

    records: list[dict] = field(default_factory=list)
    resumed: int = 0

    @property
    def failed(self) -> int:
        """Prompts whose run raised (the record holds the error)."""
        return sum("error" in r for r in self.records)

    @property
    def with_message(self) -> int:
        """Outputs empty or incomplete (cut short by the budget, every particle dead)."""
        return sum(bool(r.get("message")) for r in self.records)

    @property
    def new_tokens(self) -> int:
        """Tokens generated, all records."""
        return sum(r.get("new_tokens", 0) for r in self.records)

    @property
    def seconds(self) -> float:
        """Generation time, all records (model loading and resumed runs' pauses aside)."""
        return sum(r.get("seconds", 0.0) for r in self.records)


def run_batch(
    pair: SMCSD,
    prompts: Sequence[Prompt],
    out_path: str | Path,
    config: SMCConfig | None = None,
    *,
    method: str = "smcsd",
    constraint: ConstraintSpec | None = None,
    on_record: OnRecord | None = None,
) -> BatchSummary:
    """Generate for every prompt not yet in ``out_path``, appending one JSON line per prompt.

    Args:
        pair: the models.
        prompts: from ``load_prompts`` (ids unique).
        out_path: the JSONL file (created, or resumed: its prompts are skipped).
        config: the settings; ``config.seed`` is the base seed each prompt's derives from.
        method: a method name (``"smcsd"`` under a constraint).
        constraint: the constraint every output satisfies, or None.
        on_record: called with (record, prompts done, prompts in all) after each.

    Returns:
        The records of ``prompts``, in their order, old and new.

    Raises:
        ValueError: no prompts, a constraint that does not compile, or a file made with other
            settings or other prompt texts.
    """
    config = check_batch(prompts, config, method, constraint)
    out_path = Path(out_path)
    existing, good = existing_records(out_path, key_fields=BATCH_KEY, writer=WRITER)
    runner = PromptRunner(pair, config, method, constraint)
    check_compatible(existing, runner.settings, prompts)
    done = {r["prompt_id"]: r for r in existing}
    fresh = (runner.record(p) for p in prompts if p.id not in done)
    return collect(out_path, good, prompts, done, fresh, on_record)


def check_batch(
    prompts: Sequence[Prompt], config: SMCConfig | None, method: str, constraint: ConstraintSpec | None
) -> SMCConfig:
    """The batch's settings (defaults filled in), or a ValueError before anything runs."""
    if not prompts:
        raise ValueError("no prompts to run")
    if constraint is not None and method != "smcsd":
        raise ValueError(f"a constraint runs with the smcsd method only, got {method!r}")
    return config or SMCConfig()


def collect(
    out_path: Path,
    good: int,
    prompts: Sequence[Prompt],
    done: dict[str, dict],
    fresh: Iterable[dict],
    on_record: OnRecord | None,
) -> BatchSummary:
    """Append the ``fresh`` records (any order) after the file's ``good`` bytes; the summary of ``prompts``.

    The file is opened at the first fresh record only, so a run refused before then leaves it as it was.
    """
    count = 0

    def tick(record: dict) -> None:
        nonlocal count
        count += 1
        if on_record is not None:
            on_record(record, count, len(prompts))

    resumed = [done[p.id] for p in prompts if p.id in done]
    for record in resumed:
        tick(record)
    fresh = iter(fresh)
    first = next(fresh, None)
    if first is not None:
        with appending(out_path, good) as f:
            for record in itertools.chain([first], fresh):
                append_record(f, record)
                done[record["prompt_id"]] = record
                tick(record)
    return BatchSummary([done[p.id] for p in prompts], resumed=len(resumed))


class PromptRunner:
    """What turns one prompt into its record, on one pair: every worker runs prompts through this.

    A record depends on its prompt, the settings and the seed made from the base seed and the
    prompt's id only, so it is the same whichever process or worker ran it, in whatever order.
    """

    def __init__(
        self, pair: SMCSD, config: SMCConfig, method: str, constraint: ConstraintSpec | None
    ) -> None:
        self.pair, self.config, self.method = pair, config, method
        self.settings = batch_settings(pair, config, method, constraint)
        self.constraint = None if constraint is None else constraint.build(pair.tokenizer, pair.eos_token_ids)

    def record(self, prompt: Prompt) -> dict:
        """One prompt's record: its key and seed, the output and its report, then the settings."""
        seed = record_seed(BATCH_KEY + (prompt.id,), self.config.seed)
        head = {"prompt_id": prompt.id, "prompt_sha": prompt_digest(prompt), "seed": seed}
        try:
            out = generate_one(
                self.pair,
                prompt.text,
                dataclasses.replace(self.config, seed=seed),
                method=self.method,
                constraint=self.constraint,
            )
        except ValueError as err:  # e.g. a prompt over the context: recorded, the batch goes on
            return head | {"error": str(err)} | self.settings
        return head | out.to_record() | self.settings

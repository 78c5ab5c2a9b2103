"""The benchmark grid runner: one JSONL record per (setting, prompt, repeat), resumable."""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import methods as registry
from ..batch import records
from ..batch.prompts import Prompt
from ..batch.records import (
    append_record,
    appending,
    check_compatible,
    existing_records,
    prompt_digest,
    record_seed,
    run_settings,
)
from ..config import SMCConfig
from ..proposals.retrieval import RetrievalDrafter
from .quality import check_answer, target_loglik_per_token
from .speed import learn_draft

if TYPE_CHECKING:
    from ..api import SMCSD

KEY_FIELDS = ("method", "n_particles", "block_size", "temperature", "prompt_id", "repeat")
# Fields that differ between two runs of the same record (machine noise), everything else must not.
TIMING_FIELDS = (
    "seconds",
    "tokens_per_second",
    "ttft_seconds",
    "target_seconds",
    "draft_seconds",
    "overhead_fraction",
    "peak_rss_mb",
    "cuda_peak_mb",
)
TEXT_CHARS = 300
WRITER = "smcsd bench"

OnRecord = Callable[[dict, int, int], None]


@dataclass(frozen=True)
class Grid:
    """The settings to benchmark: methods x N x K x temperatures.

    A method without particles is run once per K (not per N), one without a draft once
    per N (not per K); one with neither once per temperature. ``base`` holds every other
    setting (max_new_tokens, ESS threshold, resampling, alpha, seed, ignore_eos); both
    temperatures (T_d and T_t) are set to each grid temperature, as in the reference's runs.
    """

    methods: Sequence[str]
    n_particles: Sequence[int] = (4,)
    block_sizes: Sequence[int] = (4,)
    temperatures: Sequence[float] = (0.7,)
    base: SMCConfig = field(default_factory=SMCConfig)

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError("give at least one method")
        for _, n, k, t in self.settings():  # bad names or values fail here, before any model loads
            self.config(n, k, t, 0)

    def settings(self) -> list[tuple[str, int | None, int | None, float]]:
        """Every (method, N or None, K or None, temperature), in grid order, without repeats."""
        out: list[tuple[str, int | None, int | None, float]] = []
        for name in self.methods:
            m = registry.get(name)
            for t in self.temperatures:
                for n in self.n_particles if m.particles else [None]:
                    for k in self.block_sizes if m.uses_draft else [None]:
                        if (name, n, k, float(t)) not in out:
                            out.append((name, n, k, float(t)))
        return out

    def config(self, n: int | None, k: int | None, t: float, seed: int) -> SMCConfig:
        """The ``SMCConfig`` of one setting (unused N or K left at the base value)."""
        return dataclasses.replace(
            self.base,
            n_particles=self.base.n_particles if n is None else n,
            block_size=self.base.block_size if k is None else k,
            draft_temperature=t,
            target_temperature=t,
            seed=seed,
        )


def record_key(record: dict) -> tuple:
    """The identity of a record: method, N, K, temperature, prompt id, repeat."""
    return tuple(record[f] for f in KEY_FIELDS)


def read_records(path: str | Path, key_fields: Sequence[str] = KEY_FIELDS, writer: str = WRITER):
    """A benchmark file's records (``batch.records.read_records`` with the grid's key)."""
    return records.read_records(path, key_fields, writer)


def run_bench(
    pair: SMCSD,
    prompts: Sequence[Prompt],
    grid: Grid,
    out_path: str | Path,
    repeats: int = 1,
    on_record: OnRecord | None = None,
    *,
    warmup: bool = True,
) -> list[dict]:
    """Run every (repeat, prompt, setting), appending one JSON line per record as it finishes.

    Records already in ``out_path`` (same key) are skipped, so a killed run resumes where it
    stopped; seeds come from the keys, so the resumed file holds the same records an
    uninterrupted run writes (timings aside). Every record carries ``run_settings`` and a
    digest of its prompt, and a file made with other settings or prompt texts is refused
    (``ValueError``), never silently reused. The file is read line by line and written one
    record at a time; it must be a regular file.

    Args:
        pair: the models.
        prompts: from ``load_prompts``.
        grid: methods and settings.
        out_path: the JSONL file (created, or appended to).
        repeats: runs of each (setting, prompt), with different seeds.
        on_record: called with (record, records done, records in all) after each is saved.
        warmup: run each method once, unrecorded, before its first timed record.

    Returns:
        The records of this grid, old and new, in run order.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not prompts:
        raise ValueError("no prompts to benchmark")
    plan = [(s, p, r) for r in range(repeats) for p in prompts for s in grid.settings()]
    out_path = Path(out_path)
    existing, good = existing_records(out_path, key_fields=KEY_FIELDS, writer=WRITER)
    settings = run_settings(pair, grid.base)
    check_compatible(existing, settings, prompts)
    done = {record_key(r): r for r in existing}
    with appending(out_path, good) as f:
        _calibrate(pair, grid, prompts)
        if any(name.startswith("racer") for name in grid.methods):
            # RACER learns across requests, as its reference does (its records then depend on
            # the ones before them in this process).
            pair.retrieval_memory = pair.retrieval_memory or RetrievalDrafter(pair.target_lm.vocab_size)
        return _run_plan(pair, grid, plan, done, settings, f, warmup=warmup, on_record=on_record)


def _run_plan(pair, grid, plan, done: dict, settings: dict, f, *, warmup, on_record) -> list[dict]:
    """Measure and append every planned record not ``done``; returns all of the plan's records."""
    results, warmed = [], set()
    for i, ((method, n, k, t), prompt, rep) in enumerate(plan):
        key = (method, n, k, t, prompt.id, rep)
        if key not in done:
            if warmup and method not in warmed:
                _warm(pair, method, prompt, grid.config(n, k, t, 0))
            warmed.add(method)
            done[key] = _measure(pair, grid, key, prompt, settings)
            append_record(f, done[key])
        results.append(done[key])
        if on_record is not None:
            on_record(done[key], i + 1, len(plan))
    return results


def _calibrate(pair: SMCSD, grid: Grid, prompts: Sequence[Prompt]) -> None:
    """Learn the draft once, from the first prompt and particle setting, unless it ships a record.

    The record is a value each request starts from, so a resumed run writes the records an
    uninterrupted one would.
    """
    particle = [(n, k, t) for name, n, k, t in grid.settings() if registry.get(name).particles]
    if particle and prompts:
        try:
            learn_draft(pair, prompts[0].text, grid.config(*particle[0], 0))
        except ValueError:
            pass  # the pair keeps its record; the measured calls record the error


def _warm(pair: SMCSD, method: str, prompt: Prompt, config: SMCConfig) -> None:
    """One short unrecorded generation: first calls pay for lazy initialization."""
    try:
        pair.generate(
            prompt.text,
            method=method,
            config=dataclasses.replace(config, max_new_tokens=min(8, config.max_new_tokens)),
        )
    except ValueError:
        pass  # the measured call records the error


def _peak_rss_mb() -> float:
    """The process's peak resident memory so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def _measure(pair: SMCSD, grid: Grid, key: tuple, prompt: Prompt, settings: dict) -> dict:
    method, n, k, t, pid, rep = key
    seed = record_seed(key, grid.base.seed)
    config = grid.config(n, k, t, seed)
    record = (
        dict(zip(KEY_FIELDS, key))
        | {"category": prompt.category, "prompt_sha": prompt_digest(prompt), "seed": seed}
        | settings
    )
    cuda = pair.target_lm.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(pair.target_lm.device)
    first: list[float] = []

    def progress(tokens: int) -> None:
        if tokens >= 1 and not first:
            first.append(time.perf_counter())

    start = time.perf_counter()
    try:
        gen = pair.generate(prompt.text, method=method, config=config, on_progress=progress)
    except ValueError as err:  # e.g. a prompt over the context: recorded, the grid goes on
        return record | {"error": str(err)}
    s, smc = gen.stats, gen.smc
    trace = smc.ess_trace if smc else None
    absent = dict.fromkeys(("acceptance", "mean_ess", "n_resamples", "log_z"))  # every method's columns
    return (
        record
        | absent
        | gen.to_record()
        | {  # the generation's own record, then the benchmark's
            "ttft_seconds": round(first[0] - start, 5) if first else None,
            "target_seconds": round(s.target_seconds, 5),
            "draft_seconds": round(s.draft_seconds, 5),
            "ess_trace": [round(float(e), 4) for e in trace] if trace else None,
            "target_loglik_per_token": target_loglik_per_token(pair, pair.encode(prompt.text), gen.token_ids),
            "correct": check_answer(gen.text, prompt.answer),
            "peak_rss_mb": _peak_rss_mb(),
            "cuda_peak_mb": round(torch.cuda.max_memory_allocated(pair.target_lm.device) / 2**20, 1)
            if cuda
            else None,
            "text": gen.text[:TEXT_CHARS],
        }
    )

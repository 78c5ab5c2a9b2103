"""Seconds a constrained SMC-SD run spends in its constraint, per cycle, for two engines side by side.

``compare_cycles`` times the grammar engine of this package against another implementation
of the same constraints (an older ``RegexConstraint`` class, loaded from a file), on the
date regex and the 3-field schema, in one process: runs alternate between the two, each
constraint object is built once and reused (a first run, then warm runs with other seeds).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from ..config import SMCConfig
from ..potentials import Constraint, JsonSchemaConstraint, RegexConstraint
from .engines import DATE, FLAT

# The 3-field schema as a regex, for an engine that compiles regexes only: the same objects.
FLAT_REGEX = (
    r'\{"name": "([^"\\\x00-\x1f]|\\["\\/bfnrt]){0,30}", "age": (0|[1-9][0-9]?|1[0-4][0-9]|150), '
    r'"city": "([^"\\\x00-\x1f]|\\["\\/bfnrt]){0,30}"\}'
)
PROMPTS = {
    "date regex": "On what date did Apollo 11 land on the Moon? Answer as YYYY-MM-DD.",
    "3-field schema": "Extract name, age and city from this text as JSON: "
    "Maria Lopez is 34 years old and lives in Madrid.",
}


class Timed(Constraint):
    """A constraint that times every call of another (``next_mask``, ``allows``, ``is_complete``)."""

    def __init__(self, inner) -> None:
        super().__init__(getattr(inner, "vocab_size", None), getattr(inner, "eos_token_ids", ()))
        self.inner, self.seconds = inner, 0.0

    def _timed(self, name: str, arg):
        start = time.perf_counter()
        try:
            return getattr(self.inner, name)(arg)
        finally:
            self.seconds += time.perf_counter() - start

    def next_mask(self, contexts):  # noqa: D102
        return self._timed("next_mask", contexts)

    def allows(self, sequences):  # noqa: D102
        return self._timed("allows", sequences)

    def is_complete(self, context):  # noqa: D102
        return self._timed("is_complete", context)


def constraint_seconds_per_cycle(pair, constraint, prompt: str, config: SMCConfig) -> tuple[float, int]:
    """Seconds one run spends in ``constraint`` per SMC cycle, and the cycles it ran."""
    from ..inference.program import SMCSDModel

    timed = Timed(constraint)
    [out] = pair.run([SMCSDModel(prompt, timed)], config)
    cycles = max(1, len(out.smc.ess_trace))
    return timed.seconds / cycles, cycles


def load_regex_class(path: str | Path):
    """The ``RegexConstraint`` class of a Python file (e.g. an older version of this package's)."""
    spec = importlib.util.spec_from_file_location("other_constraints", Path(path))
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RegexConstraint


def compare_cycles(
    pair, other_regex_class, config: SMCConfig, seeds: Sequence[int] = (1, 2, 3, 4, 5)
) -> list[dict]:
    """Per task and engine: build seconds, the first run's and the warm runs' median ms per cycle."""
    tok, eos = pair.tokenizer, pair.eos_token_ids
    makers = {
        "date regex": {
            "llguidance": lambda: RegexConstraint(DATE, tok, eos),
            "other": lambda: other_regex_class(DATE, tok, eos),
        },
        "3-field schema": {
            "llguidance": lambda: JsonSchemaConstraint(FLAT, tok, eos),
            "other": lambda: other_regex_class(FLAT_REGEX, tok, eos),
        },
    }
    rows = []
    for task, make in makers.items():
        built, first, warm = {}, {}, {e: [] for e in make}
        for engine, factory in make.items():
            start = time.perf_counter()
            built[engine] = (factory(), time.perf_counter() - start)
        for i, seed in enumerate((config.seed, *seeds)):
            for engine in make:  # alternate: machine noise falls on both
                call = dataclasses.replace(config, seed=seed)
                ms = 1000 * constraint_seconds_per_cycle(pair, built[engine][0], PROMPTS[task], call)[0]
                (warm[engine].append(ms) if i else first.__setitem__(engine, ms))
        for engine in make:
            rows.append(
                dict(
                    task=task,
                    engine=engine,
                    build_s=built[engine][1],
                    first_ms=first[engine],
                    warm_ms=statistics.median(warm[engine]),
                )
            )
    return rows

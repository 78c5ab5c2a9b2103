"""JSON extraction with a flat and a nested schema: SMC-SD vs AR under the mask vs token-level SMC.

Three ways to get schema-valid JSON from the same target, on the same prompts and seeds,
interleaved in one process (repeat -> task -> text -> method):

* ``smcsd``: the SMC-SD program with a ``JsonSchemaConstraint`` in proposal mode (N
  particles, blocks of K drafted tokens, the run's cut); ``smcsd_paper``: the same without
  the cut (the paper's algorithm: every cycle drafts K tokens);
* ``ar_masked``: the target alone, one token at a time from its distribution restricted to
  the allowed tokens: what a user of a serving engine's structured outputs gets (the same
  engine with one particle and a record that says the draft does not pay);
* ``genlm_awrs``: genlm-control's token-level SMC (AWRS) with its own ``JsonSchema``
  potential, N particles.

Each returned text is parsed and validated against the schema (validity) and compared
field by field with the answer written into the task (field accuracy); tokens/s is the
mean tokens per particle (EOS included) over the wall time of the call.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jsonschema

from ..config import DraftRecord, SMCConfig
from ..inference.program import SMCSDModel
from ..names import JSON_METHODS
from ..potentials import JsonSchemaConstraint
from . import steering
from .engines import FLAT, NESTED


@dataclass(frozen=True)
class Extraction:
    """A text to extract from, and the object a correct extraction equals."""

    text: str
    answer: dict


def _flat(text: str, name: str, age: int, city: str) -> Extraction:
    """A flat task's text and its answer: the person's name, age and city."""
    return Extraction(text, {"name": name, "age": age, "city": city})


def _nested_answer(name: str, languages: list[str], city: str, country: str) -> dict:
    """A nested task's answer: the person's name, languages and address."""
    return {"name": name, "languages": languages, "address": {"city": city, "country": country}}


TASKS: dict[str, tuple[dict, str, tuple[Extraction, ...]]] = {
    "flat": (
        FLAT,
        "the person's name, age and city",
        (
            _flat("Maria Lopez is 34 years old and lives in Madrid.", "Maria Lopez", 34, "Madrid"),
            _flat("Tom Baker, aged 52, runs a bakery in Chicago.", "Tom Baker", 52, "Chicago"),
            _flat("At 27, Aiko Tanaka moved to Osaka for work.", "Aiko Tanaka", 27, "Osaka"),
            _flat("The painter Jean Dupont, 61, has a studio in Paris.", "Jean Dupont", 61, "Paris"),
        ),
    ),
    "nested": (
        NESTED,
        "the person's name, the languages they speak and their address (city, country)",
        (
            Extraction(
                "Ana Silva lives in Lima, Peru, and speaks Spanish and English.",
                _nested_answer("Ana Silva", ["Spanish", "English"], "Lima", "Peru"),
            ),
            Extraction(
                "Omar Haddad speaks Arabic and French; his home is in Beirut, Lebanon.",
                _nested_answer("Omar Haddad", ["Arabic", "French"], "Beirut", "Lebanon"),
            ),
            Extraction(
                "Li Wei, who speaks Mandarin, lives in Shanghai, China.",
                _nested_answer("Li Wei", ["Mandarin"], "Shanghai", "China"),
            ),
            Extraction(
                "Greta Berg from Oslo, Norway, speaks Norwegian and German.",
                _nested_answer("Greta Berg", ["Norwegian", "German"], "Oslo", "Norway"),
            ),
        ),
    ),
}
METHODS = JSON_METHODS


def prompt(task: str, text: str) -> str:
    """The instruction for one text of a task."""
    return f"Extract {TASKS[task][1]} from this text as JSON: {text}"


def _leaves(obj, prefix: str = "") -> dict[str, object]:
    """Fields by path; a list of strings counts as one field, compared as a set."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out |= _leaves(v, f"{prefix}{k}.")
        return out
    if isinstance(obj, list):
        return {prefix[:-1]: frozenset(str(x).strip().casefold() for x in obj)}
    return {prefix[:-1]: str(obj).strip().casefold()}


def score(text: str, schema: dict, answer: dict) -> tuple[bool, float]:
    """(the text is JSON valid under the schema, the share of the answer's fields it gets right)."""
    try:
        obj = json.loads(text)
        jsonschema.validate(obj, schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False, 0.0
    want, got = _leaves(answer), _leaves(obj)
    return True, sum(got.get(k) == v for k, v in want.items()) / len(want)


@dataclass
class Run:
    """One method on one text: what it returned and what it cost."""

    method: str
    task: str
    text: str
    valid: bool
    accuracy: float
    tokens: float
    seconds: float


def _smcsd(pair, schema: JsonSchemaConstraint, text: str, config: SMCConfig, record) -> tuple[str, float]:
    """One SMC-SD program run; (returned text, mean tokens per particle)."""
    [ticket] = pair.engine.run([SMCSDModel(text, schema)], config, record=record)
    out = ticket.wait()
    particles = out.smc.particles
    return out.text, statistics.fmean(len(p.token_ids) for p in particles) if particles else 0.0


def run_method(
    method: str, pair, task: str, item: Extraction, constraint, config: SMCConfig, lms=None
) -> Run:
    """Run one method on one text (``constraint``: the task's ``JsonSchemaConstraint`` or genlm one).

    ``lms``: the ``steering.TokenLMs`` that ``genlm_awrs`` reads the target through (None: its own).
    """
    schema = TASKS[task][0]
    start = time.perf_counter()
    text, tokens = pair.call(functools.partial(_run, method, pair, task, item, constraint, config, lms))
    seconds = time.perf_counter() - start
    valid, accuracy = score(text.strip(), schema, item.answer)
    return Run(method, task, item.text, valid, accuracy, tokens, seconds)


def _run(method: str, pair, task: str, item: Extraction, constraint, config: SMCConfig, lms) -> tuple:
    """One method's (text, tokens) on one text, on the torch thread."""
    if method in ("smcsd", "smcsd_paper"):
        call = config if method == "smcsd" else dataclasses.replace(config, cut=None)
        text, tokens = _smcsd(pair, constraint, prompt(task, item.text), call, None)
    elif method == "ar_masked":  # one particle, the target alone from the first token
        # The target alone: one particle, no retrieval, and a record that turns the draft off.
        cut = config.cut if config.cut is not None else 0.3
        alone = dataclasses.replace(config, n_particles=1, cut=cut, proposal="draft")
        text, tokens = _smcsd(pair, constraint, prompt(task, item.text), alone, DraftRecord(0, 50))
    elif method == "genlm_awrs":
        rec = steering.genlm_smc(
            pair.context(config),
            prompt(task, item.text),
            constraint,
            n_particles=config.n_particles,
            max_new_tokens=config.max_new_tokens,
            temperature=config.target_temperature,
            seed=config.seed,
            sampler="awrs",
            lms=lms,
        )
        text, tokens = rec.text, rec.tokens
    else:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    return text, tokens


def compare_json(
    pair,
    tasks: Sequence[str] = tuple(TASKS),
    methods: Sequence[str] = METHODS,
    config: SMCConfig | None = None,
    *,
    repeats: int = 1,
    on_run: Callable[[Run], None] | None = None,
    twist: str | None = None,
) -> list[Run]:
    """Every method on every text of every task, ``repeats`` times with seeds ``seed + repeat``.

    ``twist``: also run each SMC-SD method with this ``SMCConfig.twist``, right after the
    method without it (same seeds), as the row ``"<method>, twist <twist>"``.
    """
    from genlm.control import JsonSchema

    config = config or SMCConfig(draft_temperature=0.7, target_temperature=0.7, max_new_tokens=96)
    unknown = [m for m in methods if m not in METHODS] + [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown {unknown}; methods: {', '.join(METHODS)}; tasks: {', '.join(TASKS)}")
    ours = {t: JsonSchemaConstraint(TASKS[t][0], pair.tokenizer, pair.eos_token_ids) for t in tasks}
    theirs = {
        t: steering.TaskConstraint(pair.tokenizer, pair.eos_token_ids, JsonSchema(TASKS[t][0]))
        for t in tasks
        if "genlm_awrs" in methods
    }
    lms = steering.TokenLMs()  # genlm-control's view of the target, built once for every run
    first = tasks[0], TASKS[tasks[0]][2][0]
    for method in methods:  # untimed: lazy imports, the token-level backend, first-call kernels
        constraint = theirs[first[0]] if method == "genlm_awrs" else ours[first[0]]
        run_method(method, pair, *first, constraint, dataclasses.replace(config, max_new_tokens=2), lms)
    runs = []
    for rep in range(repeats):
        call = dataclasses.replace(config, seed=config.seed + rep)
        for task in tasks:
            for item in TASKS[task][2]:
                for method, twisted in _variants(methods, twist):
                    constraint = theirs[task] if method == "genlm_awrs" else ours[task]
                    with_twist = dataclasses.replace(call, twist=twisted)
                    run = run_method(method, pair, task, item, constraint, with_twist, lms)
                    if twisted is not None:
                        run = dataclasses.replace(run, method=f"{method}, twist {twisted}")
                    runs.append(run)
                    if on_run is not None:
                        on_run(runs[-1])
    return runs


def _variants(methods: Sequence[str], twist: str | None) -> list[tuple[str, str | None]]:
    """(method, twist) in run order: each SMC-SD method again with ``twist`` right after it."""
    out = []
    for m in methods:
        out.append((m, None))
        if twist is not None and m in ("smcsd", "smcsd_paper"):
            out.append((m, twist))
    return out


@dataclass(frozen=True)
class Summary:
    """One method on one task over its texts and repeats."""

    task: str
    method: str
    validity: float
    accuracy: float
    tokens_per_second: float
    seconds: float
    runs: int


def summarize(runs: Sequence[Run]) -> list[Summary]:
    """Means of validity and field accuracy; tokens/s as total tokens over total seconds."""
    out = []
    for task, method in dict.fromkeys((r.task, r.method) for r in runs):
        mine = [r for r in runs if r.task == task and r.method == method]
        seconds = sum(r.seconds for r in mine)
        out.append(
            Summary(
                task,
                method,
                statistics.fmean(r.valid for r in mine),
                statistics.fmean(r.accuracy for r in mine),
                sum(r.tokens for r in mine) / seconds if seconds > 0 else 0.0,
                statistics.median(r.seconds for r in mine),
                len(mine),
            )
        )
    return out

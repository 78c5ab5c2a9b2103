"""Constrained generation side by side: SMC-SD programs vs LLaMPPL, genlm-control and rejection.

Every method runs on every task in one process, interleaved (repeat -> task -> method,
same seeds), so machine noise spreads evenly; rows are medians over repeats (validity:
means). See ``smcsd_ppl.bench.steering`` for the runners and what they time.

``smcsd_plain`` (the same loop without the constraint) is the speed reference of the
constrained program: when ``smcsd_proposal`` runs too, ``smcsd_plain`` emits exactly as
many tokens as that run's particles did on average (EOS included there, ignored here), so
tokens/s compare at equal length. Tokens/s everywhere = mean tokens per particle / seconds.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..backends.base import ForwardStats
from ..config import SMCConfig
from ..methods.hf_assisted import count_forwards
from ..methods.registry import RunContext
from . import steering
from .quality import target_loglik_per_token
from .steering import SteeringRecord, TaskConstraint, TokenLMs


@dataclass(frozen=True)
class Task:
    """A prompt, the constraint its answer must satisfy, and what the answer must mean.

    ``constraint`` is a regex or a genlm-control byte potential; ``meaning`` checks what the form
    cannot (None: the form is all).
    """

    name: str
    prompt: str
    constraint: object
    meaning: Callable[[str], bool] | None = None


def is_calendar_date(text: str) -> bool:
    """A real date in YYYY-MM-DD (not 1500-15-25)."""
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


def is_person(text: str) -> bool:
    """JSON that parses into ``{"name": str, "age": int}``."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age"}
        and isinstance(value["name"], str)
        and type(value["age"]) is int
    )


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "date",
            "When did the first moon landing happen? Answer with a date.",
            r"\d{4}-\d{2}-\d{2}",
            is_calendar_date,
        ),
        Task(
            "phone",
            "Give the phone number of a pizza place in New York. Answer with a US phone number.",
            r"\(\d{3}\) \d{3}-\d{4}",
        ),
        Task(
            "json",
            "Describe a fictional person as a JSON object with a name and an age.",
            r'\{"name": "[A-Z][a-z]{1,9}( [A-Z][a-z]{1,9})?", "age": \d{1,2}\}',
            is_person,
        ),
        Task(
            "short_words",
            "Describe a cat in one sentence, using only words of at most five letters.",
            r"[A-Za-z]{1,5}(,? [A-Za-z]{1,5})*[.!]?",
        ),
    )
}

METHODS = steering.STEERING_METHODS  # the comparison runs the steering methods, by their names
SMCSD_METHODS = steering.SMCSD_STEERING


@dataclass
class CompareRow:
    """One method on one task, summarized over repeats.

    ``validity`` is the share of final particles that are valid (positive weight, constraint
    satisfied), ``output_validity`` the share of runs whose returned text is valid;
    ``loglik_per_token`` is the untempered target's mean log p of the returned tokens given
    the (chat-templated) prompt; ``ess`` is the final ESS; ``target_forwards`` counts the
    target's forward calls in a run, the prompt's prefill included.
    """

    method: str
    task: str
    validity: float
    output_validity: float
    tokens_per_second: float
    tokens: float
    seconds: float
    loglik_per_token: float
    log_z: float
    ess: float
    target_forwards: float
    runs: int
    example: str


COMPARE_CONFIG = SMCConfig(
    n_particles=8, block_size=8, max_new_tokens=32, draft_temperature=0.7, target_temperature=0.7
)
"""The comparison's defaults (the cut as in SMCConfig)."""


def compare_constrained(
    pair,
    tasks: Sequence[Task],
    methods: Sequence[str] = tuple(METHODS),
    config: SMCConfig = COMPARE_CONFIG,
    *,
    repeats: int = 1,
    on_run: Callable[[str, str, SteeringRecord], None] | None = None,
) -> list[CompareRow]:
    """Run every method on every task ``repeats`` times, interleaved; one row per (task, method).

    ``config`` gives N, K, the budget, the seed, the cut (SMC-SD rows) and one temperature
    for both models (``target_temperature``).
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {tuple(METHODS)}")
    if not tasks:
        raise ValueError("give at least one task")
    constraints = {
        t.name: TaskConstraint(pair.tokenizer, pair.eos_token_ids, t.constraint, t.meaning) for t in tasks
    }
    ctx = pair.context()  # the runners' view of the pair; each SMC-SD run sets its own config
    lms = TokenLMs()  # the token-level libraries' view of the target, built once for every run
    n_particles, block_size, cut, seed = config.n_particles, config.block_size, config.cut, config.seed
    kw = dict(
        n_particles=n_particles, max_new_tokens=config.max_new_tokens, temperature=config.target_temperature
    )
    pair.call(functools.partial(_warm_up, ctx, tasks[0], constraints[tasks[0].name], methods, lms, **kw))
    runs: dict[tuple[str, str], list[tuple[SteeringRecord, float]]] = {}
    # On the input embeddings: the one module every forward calls, ours and the model's own alike.
    forwards = ForwardStats()
    with count_forwards(pair.target.model.get_input_embeddings(), forwards):
        for rep, task in itertools.product(range(repeats), tasks):
            done: dict[str, SteeringRecord] = {}
            for method in methods:
                extra = {"block_size": block_size, "cut": cut} if method in SMCSD_METHODS else {"lms": lms}
                if method == "smcsd_plain" and "smcsd_proposal" in done:  # length-matched reference
                    extra |= {
                        "ignore_eos": True,
                        "max_new_tokens": max(1, round(done["smcsd_proposal"].tokens)),
                    }
                before = forwards.calls
                run = functools.partial(
                    METHODS[method],
                    ctx,
                    task.prompt,
                    constraints[task.name],
                    seed=seed + rep,
                    **{**kw, **extra},
                )
                rec = pair.call(run)  # on the torch thread, as every run of the library
                rec.target_forwards = forwards.calls - before
                done[method] = rec
                ll = target_loglik_per_token(pair, pair.encode(task.prompt), rec.token_ids)
                ll = math.nan if ll is None else ll  # an empty output
                runs.setdefault((task.name, method), []).append((rec, ll))
                if on_run is not None:
                    on_run(task.name, method, rec)
    return [_row(task, method, recs) for (task, method), recs in runs.items()]


def _warm_up(
    ctx: RunContext, task: Task, constraint: TaskConstraint, methods: Sequence[str], lms: TokenLMs, **kw
) -> None:
    """Untimed short runs: lazy imports, the shared token-level backend, first-call kernels."""
    kw = {**kw, "max_new_tokens": 2}
    if any(m in SMCSD_METHODS for m in methods):
        steering.smcsd_plain(ctx, task.prompt, constraint, **kw)
    if any(m in steering.TOKEN_STEERING for m in methods):
        steering.genlm_smc(ctx, task.prompt, constraint, lms=lms, **kw)


def _median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def _row(task: str, method: str, recs: list[tuple[SteeringRecord, float]]) -> CompareRow:
    rs = [r for r, _ in recs]
    return CompareRow(
        method,
        task,
        statistics.fmean(r.validity for r in rs),
        statistics.fmean(r.selected_valid for r in rs),
        _median([r.tokens_per_second for r in rs]),
        _median([r.tokens for r in rs]),
        _median([r.seconds for r in rs]),
        _median([ll for _, ll in recs]),
        _median([math.nan if r.log_z is None else r.log_z for r in rs]),
        _median([math.nan if r.ess is None else r.ess for r in rs]),
        _median([r.target_forwards for r in rs]),
        len(rs),
        rs[0].text,
    )


def summaries(rows: Sequence[CompareRow], repeats: int, method: str = "smcsd_proposal") -> list[str]:
    """One line per task: each method's quality (valid outputs, log p/token, log Z) beside its speed.

    Speed ratios against ``method`` are given only against methods that returned a valid output,
    and only from repeated runs (a single run's timing is noise).
    """
    lines = []
    for task in dict.fromkeys(r.task for r in rows):
        by = {r.method: r for r in rows if r.task == task}
        quality = "; ".join(
            f"{m} {r.output_validity:.0%} valid, log p/tok {r.loglik_per_token:.2f}, log Z {r.log_z:.1f}, "
            f"{r.tokens_per_second:.1f} tok/s"
            for m, r in by.items()
        )
        lines.append(f"{task}: {quality}")
        if method not in by:
            continue
        if repeats < 2:
            lines.append(f"{task}: speed ratios need --repeats 2 or more (one run's timing is noise)")
            continue
        ratios = {m: v for m, v in speed_ratios(rows, method)[task].items() if by[m].output_validity > 0}
        if ratios:
            lines.append(
                f"{task}: {method} tokens/s = " + ", ".join(f"{v:.2f}x {m}" for m, v in ratios.items())
            )
    return lines


def speed_ratios(rows: Sequence[CompareRow], method: str = "smcsd_proposal") -> dict[str, dict[str, float]]:
    """Per task, ``method``'s tokens/s divided by every other method's (nan where one is 0)."""
    out: dict[str, dict[str, float]] = {}
    for task in dict.fromkeys(r.task for r in rows):
        by = {r.method: r for r in rows if r.task == task}
        if method in by:
            mine = by[method].tokens_per_second
            out[task] = {
                m: mine / r.tokens_per_second if r.tokens_per_second else math.nan
                for m, r in by.items()
                if m != method
            }
    return out

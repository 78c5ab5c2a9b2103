"""The paper's SMC-SD on the static path: requests prefilled, then one graph per cycle.

The host's part of a cycle is what it can know without the device: each row's uniforms
(hashes of the request's seed, the cycle and the particle's slot, as ``inference.streams``
makes them) and each request's resampling points (``smc.POINTS`` from the cycle's
generator, as ``inference.step`` draws them). The cycle itself (``static_cycle``) runs on
the device; the host reads its report once, to grow each particle's tokens and see who
is done. What comes back is what the eager kernel returns for the same requests and seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import smc
from ..backends.base import Timer, check_prompts, pad_left, to_device
from ..config import DraftRecord, SMCConfig
from ..keys import derive, generator, mix64
from ..results import ParticleOut, SMCInfo
from ..verification import draw_restricted
from .outcome import COLLAPSE_ESS_FRACTION
from .static_cycle import CycleState, smcsd_cycle
from .static_engine import StaticEngine
from .streams import block_uniforms, row_key

NO_EOS = -1  # stands for the EOS ids when none are in force (isin over an empty set is avoided)


def check_static(config: SMCConfig) -> None:
    """Refuse settings the static path does not run (yet): it runs the paper's algorithm only."""
    if config.cut is not None or config.proposal not in ("draft", "auto") or config.token_level:
        raise ValueError("the compiled engine runs the paper's algorithm (--method smcsd_paper) only")
    if config.resampling not in smc.POINTS:
        raise ValueError(
            f"the compiled engine resamples with one of {tuple(smc.POINTS)}, not {config.resampling!r}"
        )


@dataclass
class StaticResult:
    """One request's output: the chosen particle's tokens (empty if all died) and SMC-SD's report."""

    token_ids: list[int]
    info: SMCInfo
    message: str = ""


@torch.inference_mode()
def static_smcsd(
    engine: StaticEngine,
    prompts: Sequence[Sequence[int]],
    config: SMCConfig,
    eos: Sequence[int],
    seeds: Sequence[int],
    *,
    on_step: Callable[[int], None] | None = None,
) -> list[StaticResult]:
    """Run the paper's SMC-SD for ``prompts`` (request i seeded ``seeds[i]``) on ``engine``'s graphs.

    With the engine's ``row_bucket`` set (``--deterministic``), requests run in batches of
    exactly that many rows, padded with finished ones, and each prompt is prefilled alone:
    every forward a request takes part in has the same shape whoever its batch-mates are.
    """
    check_static(config)
    check_prompts(prompts, engine.target.max_length)
    n = config.n_particles
    per = engine.row_bucket // n if engine.row_bucket else len(prompts)
    if per < 1:
        raise ValueError(f"a row bucket of {engine.row_bucket} cannot hold a request of {n} particles")
    out: list[StaticResult] = []
    for start in range(0, len(prompts), per):
        batch = list(prompts[start : start + per])
        out += _run(engine, batch, config, eos, list(seeds[start : start + per]), on_step)
    return out


def _run(engine: StaticEngine, prompts, config: SMCConfig, eos, seeds, on_step) -> list[StaticResult]:
    """One batch of requests, padded to the row bucket when there is one, run to its end."""
    real, n, k = len(prompts), config.n_particles, config.block_size
    if engine.row_bucket:
        pad = engine.row_bucket // n - real
        prompts, seeds = prompts + [prompts[0]] * pad, seeds + [0] * pad
    b = len(prompts)
    target, draft, state = _prefilled(engine, prompts, config, eos, seeds, real)
    histories = [[int(t)] for t in state.pend_t.tolist()]  # the leads (host data: drawn below)
    # a lead is the first cycle's: that cycle runs even if every lead ended; padding is done
    done = [r >= real * n for r in range(b * n)]
    cycle = engine.graph(
        ("smcsd", n, k, config.alpha, config.ess_threshold),
        lambda: smcsd_cycle(engine.target, engine.draft, n, k, config.alpha, config.ess_threshold),
    )
    traces = [([], [], 0) for _ in range(b)]  # per request: ESS per cycle, ESS fractions, resamples
    step = 1
    while not all(done):
        u = torch.tensor([row for seed in seeds for row in _uniforms(seed, step, n, k)], dtype=torch.float64)
        points = torch.stack(
            [smc.POINTS[config.resampling](generator(derive(s, "resample", step)), n) for s in seeds]
        )
        device = engine.target.device
        with Timer(engine.target_stats, device, b * n * (k + 1)):
            (report,) = cycle(
                *target.flat(), *draft.flat(), *state.flat(), to_device(u, device), to_device(points, device)
            )
        engine.draft_stats.calls += k
        rows = report.tolist()  # the cycle's one host read
        histories, done, ancestors = _read(rows, histories, done, k, n, traces)
        for arena in (target, draft):  # the KV rows follow their particles (the state did, in the cycle)
            arena.move_rows_(ancestors)
        if on_step is not None:
            on_step(max(len(h) for h in histories[: real * n]))
        step += 1
    log_w = state.log_w.view(b, n).tolist()
    return [
        _result(histories[i * n : (i + 1) * n], log_w[i], traces[i], config, seeds[i]) for i in range(real)
    ]


def _prefilled(engine: StaticEngine, prompts, config: SMCConfig, eos, seeds, real: int):
    """Both arenas holding each prompt in its N rows, and the state after each particle's lead.

    Requests past the first ``real`` are padding: done from the start.
    """
    b, n, k = len(prompts), config.n_particles, config.block_size
    width = max(len(p) for p in prompts) + config.max_new_tokens + k + 2
    target, draft = engine.arena("target", b * n, width), engine.arena("draft", b * n, width)
    device = engine.target.device
    # alone (a row bucket): the prefill's shape is the request's own, whatever its batch-mates
    groups = [[i] for i in range(b)] if engine.row_bucket else [list(range(b))]
    logits = []
    for group in groups:
        ids, valid = pad_left([prompts[i] for i in group], device)
        span = slice(group[0], group[-1] + 1)
        logits.append(engine.target.forward(target.rows(span), ids, valid, last_only=True)[:, -1])
        engine.draft.forward(draft.rows(span), ids, valid, last_only=True)
    logits = torch.cat(logits)
    engine.target_stats.calls += len(groups)
    engine.draft_stats.calls += len(groups)
    spread = torch.arange(b, device=device).repeat_interleave(n)
    target.gather_(spread)
    draft.gather_(spread)
    u = torch.tensor([row[0] for s in seeds for row in _uniforms(s, 1, n, k)], dtype=torch.float64)
    temps = torch.tensor([[config.target_temperature], [config.draft_temperature]]).expand(2, b * n)
    scaled = logits.float().index_select(0, spread) / temps[0, :, None].to(device)
    lead, lead_w = draw_restricted(scaled, config.alpha, None, u)
    eos_ids = torch.tensor(sorted({int(e) for e in eos}) or [NO_EOS], device=device)
    budget = torch.full_like(lead, config.max_new_tokens)
    state = engine.buffers(
        ("smcsd-state", b * n, len(eos_ids)), lambda: _empty_state(b * n, len(eos_ids), device)
    )
    state.pend_t.copy_(lead)
    state.pend_d.copy_(torch.stack([lead, lead], 1))
    state.pend_d_valid.copy_(torch.tensor([False, True]).expand(b * n, 2))
    padding = torch.arange(b * n, device=device) >= real * n
    ended = torch.isin(lead, eos_ids) | (budget <= 1) | padding
    state.done.copy_(ended)
    state.log_w.copy_(torch.where(ended, lead_w.double(), 0.0))  # a row its lead ended is weighed now
    state.n_gen.fill_(1)
    state.budget.copy_(budget)
    state.temps.copy_(temps)
    state.eos.copy_(eos_ids)
    state.lead_w.copy_(torch.where(ended, 0.0, lead_w))
    return target, draft, state


def _empty_state(rows: int, n_eos: int, device: torch.device) -> CycleState:
    def z(*shape, dtype=torch.long):
        return torch.zeros(shape, dtype=dtype, device=device)

    return CycleState(
        pend_t=z(rows),
        pend_d=z(rows, 2),
        pend_d_valid=z(rows, 2, dtype=torch.bool),
        log_w=z(rows, dtype=torch.float64),
        done=z(rows, dtype=torch.bool),
        n_gen=z(rows),
        budget=z(rows),
        temps=z(2, rows, dtype=torch.float32),
        eos=z(n_eos),
        lead_w=z(rows, dtype=torch.float32),
    )


def _uniforms(seed: int, cycle: int, n: int, k: int) -> list[list[float]]:
    """The uniforms of a request's N rows in a cycle: the eager kernel's (first service of each row)."""
    return [block_uniforms(mix64(row_key(seed, cycle, slot, 0) ^ 0), k + 2) for slot in range(n)]


def _read(rows: list[list[float]], histories: list[list[int]], was_done: list[bool], k: int, n: int, traces):
    """Grow each particle's tokens by the report, then take the ancestors; record running requests' ESS.

    ``histories`` grows in place; only rows whose ancestor is another get a copy of its tokens.
    """
    if any(row[k + 6] for row in rows):
        raise ValueError("the model produced NaN logits (try dtype=float32, or check the weights)")
    for h, row in zip(histories, rows):
        h.extend(int(t) for t in row[: int(row[k + 1])])
    for i, (trace, fractions, resamples) in enumerate(traces):
        if all(was_done[i * n : (i + 1) * n]):
            continue  # finished before this cycle: the eager kernel had retired it
        ess, did = rows[i * n][k + 4], bool(rows[i * n][k + 5])
        trace.append(ess)
        if n >= 2 and ess > 0:  # 0: every weight was zero, no fraction recorded
            fractions.append(ess / n)
        traces[i] = (trace, fractions, resamples + did)
    ancestors = [int(row[k + 2]) for row in rows]
    if any(a != r for r, a in enumerate(ancestors)):
        histories = [
            h if a == r else list(histories[a]) for r, (h, a) in enumerate(zip(histories, ancestors))
        ]
    return histories, [bool(row[k + 3]) for row in rows], ancestors


def _result(histories, log_w: list[float], trace, config: SMCConfig, seed: int) -> StaticResult:
    """A request's result: its output particle drawn by weight (or the heaviest), as the eager kernel does."""
    ess_trace, fractions, resamples = trace
    w = smc.clean_log_weights(torch.tensor(log_w, dtype=torch.float64))
    n = len(log_w)
    finite = bool(torch.isfinite(w).any())
    several = list(ess_trace) if n >= 2 else []
    info = SMCInfo(
        log_z=smc.log_mean_exp(w) if finite else -math.inf,
        particles=[ParticleOut(h, "", float(x)) for h, x in zip(histories, w)],
        ess_trace=list(ess_trace),
        particle_trace=[n] * len(ess_trace),
        mean_ess=statistics.fmean(several) if several else smc.ess(w),
        n_resamples=resamples,
        collapsed=bool(fractions) and statistics.fmean(fractions) < COLLAPSE_ESS_FRACTION,
        draft_record=DraftRecord(),
    )
    if not finite:
        return StaticResult(
            [], info, "every particle has zero weight: no particle satisfied the program's conditions"
        )
    if config.selection == "argmax":
        chosen = int(torch.argmax(w))
    else:
        chosen = int(smc.resample(w, "multinomial", generator(derive(seed, "choose")), 1)[0])
    return StaticResult(list(histories[chosen]), info)

"""The device check's static-path part: the compiled engine beside the eager one, on the same models.

``smcsd device-check --engine compiled`` adds this to the report: the static forward's bf16
logits against plain forwards; the cost of one static forward at 1, 8, 72 and 144 positions
(one graph each); AR and the paper's SMC-SD (N = 8, K = 8) on both engines, interleaved, at
each prompt length; the time spent compiling or capturing; and host reads per SMC-SD cycle.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ..api import SMCSD
from ..backends.graphs import Graphed
from ..backends.static import Arena, StaticLlama
from ..backends.syncs import HostReads
from ..config import SMCConfig
from ..engine.pair import STATIC_METHODS
from ..inference.static_engine import StaticEngine
from ..inference.static_smcsd import static_smcsd
from ..inference.step import request_seed
from ..models import LoadedModel
from .speed import timed_run

FORWARD_SHAPES = ((1, 1), (8, 1), (8, 9), (16, 9))  # rows x positions: 1, 8, 72, 144


def static_report(
    target: LoadedModel,
    draft: LoadedModel,
    prompts: dict[str, list[int]],
    config: SMCConfig,
    repeats: int,
    engine: str = "compiled",
) -> dict:
    """The static path's part of the device check, as a dict (``prompts``: label -> token ids)."""
    eager = SMCSD(target, draft, chat=False)
    fast = SMCSD(target, draft, chat=False, engine=engine)
    static = fast.core.static_engine("ar")
    out = {"mode": static.mode, "equivalence_max_rel_err": round(equivalence(static.target, target.model), 5)}
    out["forward_ms"] = forward_ms(static.target, static.mode)
    by_prompt = {}
    for label, prompt in prompts.items():
        rows = {
            f"{m} ({e})": (pair, m) for e, pair in (("eager", eager), (engine, fast)) for m in STATIC_METHODS
        }
        for pair, method in rows.values():  # builds every graph, untimed
            timed_run(pair, method, prompt, config)
        runs: dict[str, list[float]] = {name: [] for name in rows}
        for rep in range(repeats):
            for name, (pair, method) in rows.items():
                runs[name].append(timed_run(pair, method, prompt, dataclasses.replace(config, seed=rep))[0])
        by_prompt[label] = {name: round(statistics.median(v), 2) for name, v in runs.items()}
    out["tokens_per_s"] = by_prompt
    out["compile_seconds"] = round(static.compile_seconds, 1)
    out["host_reads_per_cycle"] = host_reads(target, draft, next(iter(prompts.values())), config)
    return out


def equivalence(model: StaticLlama, hf_model, seed: int = 0) -> float:
    """Max relative error of static logits (ragged prompts, then one step) against plain forwards."""
    vocab = hf_model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 3, 6, 1)]
    arena = model.arena(len(prompts), 64)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], valid[i, width - len(p) :] = torch.tensor(p), True
    nxt = torch.randint(3, vocab, (len(prompts), 1), generator=g)
    err = 0.0
    with torch.inference_mode():
        model.forward(arena, ids.to(model.device), valid.to(model.device))
        got = model.forward(
            arena, nxt.to(model.device), torch.ones_like(nxt, dtype=torch.bool).to(model.device)
        )
        for i, p in enumerate(prompts):
            want = hf_model(torch.tensor([p + nxt[i].tolist()], device=model.device)).logits[0, -1].float()
            err = max(err, float((got[i, -1].cpu() - want.cpu()).abs().max() / want.abs().max().cpu()))
    return err


def forward_ms(model: StaticLlama, mode: str, cache: int = 128, repeats: int = 5) -> dict[str, float]:
    """Median ms of one static forward (a graph each) of rows x positions after ``cache`` tokens."""
    out = {}
    for rows, t in FORWARD_SHAPES:
        arena = model.arena(rows, cache + 2 * t + 16)

        def step(*args, rows=rows, t=t):
            a = Arena.of(args[:-1])
            a.lengths.fill_(cache)  # every run reads the same columns
            valid = torch.ones(rows, t, dtype=torch.bool, device=args[-1].device)
            return (model.forward(a, args[-1], valid),)

        graph = Graphed(step, mode)
        tokens = torch.full((rows, t), 5, device=model.device)
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 2):  # the first ones build and warm the graph
                _sync(model.device)
                start = time.perf_counter()
                graph(*arena.flat(), tokens)
                _sync(model.device)
                times.append(time.perf_counter() - start)
        out[f"{rows * t}"] = round(1000 * statistics.median(times[2:]), 3)
    return out


def host_reads(target: LoadedModel, draft: LoadedModel, prompt: list[int], config: SMCConfig) -> float:
    """Host reads per SMC-SD cycle of the static path: the slope between a short run and a longer one.

    Counted on the uncompiled step (the same function the graphs run: a counting mode cannot
    enter a compiled graph); a run's set-up reads (the leads, the final weights) cancel out.
    """
    engine = StaticEngine(target.model, draft.model, "eager")
    counts = []
    for tokens in (2 * config.block_size, 6 * config.block_size):
        short = dataclasses.replace(config, max_new_tokens=tokens, cut=None, proposal="draft")  # the paper's
        with HostReads([target.model, draft.model]) as reads:
            (out,) = static_smcsd(engine, [prompt], short, [], [request_seed(short.seed, 0)])
        counts.append((reads.count, len(out.info.ess_trace)))
    (r1, c1), (r2, c2) = counts
    return round((r2 - r1) / max(1, c2 - c1), 3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

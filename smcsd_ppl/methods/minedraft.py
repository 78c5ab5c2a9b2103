"""MineDraft-style batch-parallel speculative decoding.

The batch is split into two balanced sub-batches A and B, each with its own row store
(own KV caches over the shared weights). While the target verifies A's block, a worker
thread drafts B's next block (B was verified the step before, so its state is final);
then the roles swap. Each side is plain exact speculative sampling on its own rows
and random generator, so the output is the target's distribution exactly, and the
threaded and sequential (``threads=False``) schedules give identical tokens.

The overlap pays only when the draft's forwards can run beside the target's: on a
2-core CPU the forwards of small models are dominated by per-op dispatch (Python and
ATen overhead, the Python part holding the GIL), so two threads do not overlap, while
halving the batch doubles the target calls. MineDraft needs the draft on its own
device (as in the paper), or kernel-bound forwards (bigger models, CUDA streams).
docs/benchmarks.md ("MineDraft") has the measurements and the commands that repeat them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..backends.base import ForwardStats
from ..backends.hf import HFBatchedLM
from ..config import SMCConfig
from ..inference.rows import RowStore
from ..results import Generation, SpeculativeInfo
from .registry import RunContext, register
from .sd import SpeculativeLoop, SpeculativeRun

SEED_STRIDE = 1_000_003  # side i samples with seed + i * SEED_STRIDE: independent streams


@dataclass
class MineDraftRun(SpeculativeRun):
    """A speculative run over two sub-batches, and its verify steps."""

    steps: int = 0  # verify steps; with threads each overlaps the other side's drafting


def split_balanced(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Two sub-batches of request indices, sizes within one, prompt tokens balanced.

    Longest prompts first, each to the side with fewer tokens so far (ties to the
    smaller side): both sides then prefill and attend over similar lengths.
    """
    sides: tuple[list[int], list[int]] = ([], [])
    load = [0, 0]
    cap = (len(prompts) + 1) // 2
    for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
        s = min((0, 1), key=lambda s: (len(sides[s]) >= cap, load[s], len(sides[s])))
        sides[s].append(i)
        load[s] += len(prompts[i])
    return sides


def minedraft_sampling(
    sides: tuple[SpeculativeLoop, SpeculativeLoop],
    prompts: Sequence[Sequence[int]],
    *,
    threads: bool = True,
    num_threads: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> MineDraftRun:
    """Exact speculative sampling with drafting of one sub-batch overlapped with verifying the other.

    Args:
        sides: two speculative loops over SEPARATE backends (forwards run concurrently),
            with their own seeds (``side_loops``).
        prompts: token ids, one request each; split by ``split_balanced``.
        threads: draft in a worker thread; False runs the same schedule sequentially.
        num_threads: torch intra-op threads during the call (process-wide in torch,
            so both concurrent forwards share it); None keeps the current setting.
        on_step: called with the longest output length after each verify step.
    """
    a, b = (side.store for side in sides)
    if a.target is b.target or a.draft is b.draft or a.target is a.draft:
        raise ValueError("MineDraft needs two loops over four separate backends (KV caches)")
    requests = split_balanced(prompts)
    sides = list(sides)
    saved_threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minedraft") if threads else None
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        for side, req in zip(sides, requests):
            side.start([prompts[r] for r in req])
        steps = _alternate(sides, pool, on_step)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        torch.set_num_threads(saved_threads)
    return _merge([s.result() for s in sides], requests, len(prompts), steps)


def _alternate(sides: list[SpeculativeLoop], pool: ThreadPoolExecutor | None, on_step) -> int:
    """Verify one side while the other drafts, swapping each step; returns the verify steps."""
    cur, nxt = sides
    steps = 0
    while cur.live or nxt.live:
        if not cur.live:
            cur, nxt = nxt, cur
        if cur.blocks is None:  # the first step, or the other side has finished
            cur.draft()
        overlap = nxt.draft if nxt.live and nxt.blocks is None else None
        job = pool.submit(overlap) if pool is not None and overlap is not None else None
        cur.verify()
        if job is not None:
            job.result()
        elif overlap is not None:
            overlap()
        steps += 1
        if nxt.live:
            cur, nxt = nxt, cur
        if on_step is not None:
            on_step(max(len(o) for s in sides for o in s.outs))
    return steps


def _merge(runs: list[SpeculativeRun], requests: tuple[list[int], list[int]], n: int, steps: int):
    """Both sides' outputs and counts back in request order."""
    merged = MineDraftRun([[] for _ in range(n)], [0] * n, [0] * n, [0] * n, steps)
    for run, reqs in zip(runs, requests):
        for local, req in enumerate(reqs):
            merged.token_ids[req] = run.token_ids[local]
            merged.drafted[req] = run.drafted[local]
            merged.accepted[req] = run.accepted[local]
    return merged


def side_loops(target: HFBatchedLM, draft: HFBatchedLM, eos: Sequence[int], config: SMCConfig):
    """Two speculative loops over fresh backends of the models (shared weights, own caches and seeds)."""
    loops = []
    for i in range(2):
        lms = [
            HFBatchedLM(lm.model, max_cache_bytes=lm.max_cache_bytes, name=f"{lm.name}[{'AB'[i]}]")
            for lm in (target, draft)
        ]
        cfg = dataclasses.replace(config, seed=config.seed + i * SEED_STRIDE)
        loops.append(SpeculativeLoop(RowStore(*lms), cfg, eos))
    return loops[0], loops[1]


@register(
    "minedraft",
    samples_target=True,
)
def _minedraft(ctx: RunContext) -> list[Generation]:
    sides = side_loops(ctx.target_lm, ctx.draft_lm, ctx.eos, ctx.config)
    try:
        run = minedraft_sampling(sides, ctx.prompts, threads=True, on_step=ctx.on_progress)
    finally:  # the call's stats read the pair's counters: add the sub-batch backends' forwards
        # (overlapped forwards both count their seconds, so forward time may exceed wall time)
        for side in sides:
            _add_forwards(ctx.target_lm.stats, side.store.target.stats)
            _add_forwards(ctx.draft_lm.stats, side.store.draft.stats)
    info = SpeculativeInfo(run.acceptance())
    return ctx.generations(run.token_ids, [info for _ in run.token_ids])


def _add_forwards(total: ForwardStats, side: ForwardStats) -> None:
    total.calls += side.calls
    total.seconds += side.seconds
    total.tokens += side.tokens

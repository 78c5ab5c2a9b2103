"""MineDraft-style batch-parallel speculative decoding (REFERENCE.md §4).

The batch is split into two balanced sub-batches A and B, each with its own engine
(own KV caches over the shared weights). While the target verifies A's block, a worker
thread drafts B's next block (B was verified the step before, so its state is final);
then the roles swap. Each side is plain exact speculative sampling on its own engine
and random generator, so the output is the target's distribution exactly, and the
threaded and sequential (``threads=False``) schedules give identical tokens.

Does the overlap pay on a 2-core CPU? No. Default pair (SmolLM2-135M target, 2-layer
slice draft, bf16), K=4, 48 new tokens (EOS ignored), batch of the 4 shortest Spec-Bench
qa/math_reasoning prompts, 3 interleaved rounds, median tokens/s, on a machine shared
with other users (load average 2.5-3 on 2 cores; acceptance 0.02):

    ==================================  ========  ========  ============  ===========
    schedule                            1 thread  2 threads target calls  vs SD (1 th)
    plain SD, whole batch (``sd``)      20.3      1.6       47            1.00
    MineDraft, sequential               13.0      ~1.0      91            0.64
    MineDraft, draft in worker thread   12.9      7.4       91            0.64
    ==================================  ========  ========  ============  ===========

With 2 torch threads every method collapses 5-15x here (OpenMP teams stall whenever
another process takes a core), so only the 1-thread column is a fair comparison; at
load ~5.5 it read 9.1 / 5.8 / 5.7 tokens/s, the same ratios.

Forward micro-benchmark at load ~2.5 (median of 8, ms): verify = target over R rows x
5 tokens, draft = 4 slice steps over R rows, one after the other or with the draft in
a worker thread:

    ===================  ======  =====  ==========  ==========  ============
    torch threads, R     verify  draft  sequential  concurrent  overlap gain
    1, R=2               78      56     136         135         1.01
    1, R=4               86      56     143         144         0.99
    2, R=2               89      61     150         149         1.01
    2, R=4               94      60     153         156         0.98
    ===================  ======  =====  ==========  ==========  ============

Why: forwards of these small models are dominated by per-op dispatch (Python and
ATen overhead; the Python part holds the GIL), so two threads do not overlap at all
(1.0x, even with one thread each). Meanwhile halving the batch
doubles the target calls, and a half-batch verify costs ~90% of a full one (78 vs
86 ms). MineDraft needs the draft on its own device (as in the paper), or forwards
that are kernel-bound rather than dispatch-bound (bigger models, CUDA streams).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..backends.hf import HFBatchedLM
from ..inference.engine import BlockEngine
from ..results import Generation
from ..spec import speculative_accept
from .registry import register
from .sd import settle

SEED_STRIDE = 1_000_003  # side i samples with seed + i * SEED_STRIDE: independent streams


@dataclass
class MineDraftRun:
    """Token ids per request and the schedule's counts."""

    token_ids: list[list[int]]
    target_calls: int  # verification forwards of both sides (prefills included)
    drafted: int
    accepted: int
    steps: int  # verify steps; with threads each overlaps the other side's drafting

    @property
    def acceptance(self) -> float:
        """Accepted / drafted tokens."""
        return self.accepted / max(1, self.drafted)


class _Side:
    """One sub-batch: its engine, requests, outputs, and the block awaiting verification."""

    def __init__(self, engine: BlockEngine, requests: list[int]) -> None:
        self.engine, self.requests = engine, requests
        self.outs: list[list[int]] = []
        self.rows: list[int] = []  # local request index of each live engine row
        self.blocks = None
        self.calls = self.drafted = self.accepted = 0

    @property
    def live(self) -> bool:
        return bool(self.rows)

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        if not self.requests:
            return
        cfg, eng = self.engine.config, self.engine
        x0, _ = eng.start([prompts[r] for r in self.requests], copies=1)
        self.outs = [[x] for x in x0]
        self.rows = [i for i, x in enumerate(x0) if x not in eng.eos and cfg.max_new_tokens > 1]
        eng.reorder(self.rows)
        self.calls = 1

    def draft(self) -> None:
        budgets = [self.engine.config.max_new_tokens - len(self.outs[r]) for r in self.rows]
        self.blocks = self.engine.draft_blocks(range(len(self.rows)), budgets, keep_probs=True)

    @torch.inference_mode()
    def verify(self) -> None:
        blocks, eng = self.blocks, self.engine
        target_probs = torch.softmax(eng.target_logits(blocks), -1)  # [R, K+1, V]
        draft_probs = torch.stack([b.draft_probs for b in blocks])  # [R, K, V]
        tokens = torch.tensor([b.tokens for b in blocks], device=draft_probs.device)
        n_acc, nxt = speculative_accept(target_probs, draft_probs, tokens, eng.g)
        self.calls += 1
        self.drafted += sum(b.kept for b in blocks)
        self.accepted += sum(min(n, b.kept) for b, n in zip(blocks, n_acc.tolist()))
        going = settle(eng, blocks, n_acc.tolist(), nxt.tolist(), [self.outs[r] for r in self.rows])
        self.rows = [self.rows[i] for i in going]
        self.blocks = None


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
    engines: tuple[BlockEngine, BlockEngine],
    prompts: Sequence[Sequence[int]],
    *,
    threads: bool = True,
    num_threads: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> MineDraftRun:
    """Exact speculative sampling with drafting of one sub-batch overlapped with verifying the other.

    Args:
        engines: two engines over SEPARATE backends (forwards run concurrently).
        prompts: token ids, one request each; split by ``split_balanced``.
        threads: draft in a worker thread; False runs the same schedule sequentially.
        num_threads: torch intra-op threads during the call (process-wide in torch,
            so both concurrent forwards share it); None keeps the current setting.
        on_step: called with the longest output length after each verify step.
    """
    a, b = engines
    if a.target is b.target or a.draft is b.draft or a.target is a.draft:
        raise ValueError("MineDraft needs two engines with four separate backends (KV caches)")
    for e in engines:
        if e.config.alpha != 1.0:
            raise ValueError("MineDraft samples the target itself: alpha must be 1")
    sides = [_Side(e, req) for e, req in zip(engines, split_balanced(prompts))]
    saved_threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minedraft") if threads else None
    steps = 0
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        for s in sides:
            s.start(prompts)
        cur, nxt = sides
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
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        torch.set_num_threads(saved_threads)
    outs: list[list[int]] = [[] for _ in prompts]
    for s in sides:
        for local, req in enumerate(s.requests):
            outs[req] = s.outs[local]
    return MineDraftRun(
        outs,
        sum(s.calls for s in sides),
        sum(s.drafted for s in sides),
        sum(s.accepted for s in sides),
        steps,
    )


def pair_engines(pair, config) -> tuple[BlockEngine, BlockEngine]:
    """Two engines over fresh backends of ``pair``'s models (shared weights, own caches)."""
    engines = []
    for i in range(2):
        lms = [
            HFBatchedLM(lm.model, max_cache_bytes=lm.max_cache_bytes, name=f"{lm.name}[{'AB'[i]}]")
            for lm in (pair.target_lm, pair.draft_lm)
        ]
        cfg = dataclasses.replace(config, seed=config.seed + i * SEED_STRIDE)
        engines.append(BlockEngine(*lms, pair.eos_for(config), cfg))
    return engines[0], engines[1]


@register("minedraft", summary="MineDraft-style SD: verify one half-batch while drafting the other")
def _minedraft(pair, ids, config, on_progress):
    engines = pair_engines(pair, config)
    try:
        run = minedraft_sampling(engines, ids, threads=True, on_step=on_progress)
    finally:  # RunStats reads the pair's counters: add the sub-batch backends' forwards
        # (overlapped forwards both count their seconds, so forward time may exceed wall time)
        for e in engines:
            for mine, total in ((e.target.stats, pair.target_lm.stats), (e.draft.stats, pair.draft_lm.stats)):
                total.calls += mine.calls
                total.seconds += mine.seconds
                total.tokens += mine.tokens
    acc = run.acceptance
    return [Generation(pair.decode(t), t, "minedraft", None, acceptance=acc) for t in run.token_ids]

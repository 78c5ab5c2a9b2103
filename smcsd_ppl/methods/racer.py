"""RACER: retrieval + logit-cue draft trees, verified with tree attention in one target forward.

Each step drafts a token tree per request (``RetrievalDrafter.build_draft_tree``:
root = the next token, already drawn from the target), scores all its nodes in ONE
target forward (the backend's ``extend_tree``), and walks it from the root: at a
node, the target's choice (argmax for ``racer``; a sample at T_t for
``racer_sampling``) either matches a child, which is accepted, or becomes the next
root. Every emitted token is therefore exactly the target's greedy token (or an
exact draw from softmax(l / T_t) given the emitted prefix): the drafts only change
how many tokens one forward yields. A sampled token is the inverse CDF of one uniform
fixed per request and output position, however many nodes a tree tried.

The index and the cue table learn from everything a call emits. A call starts from empty
ones unless the caller keeps a ``RetrievalDrafter`` across calls (``SMCSD.retrieval_memory``),
as the RACER reference does: that is faster on repeated content, but the trees, hence
the forwards' shapes and (through rounding in low precision) the outputs, then depend on
earlier calls.

On CPU a 64-node tree forward costs about twice a one-token forward, so smaller
trees pay off sooner there; docs/benchmarks.md ("RACER draft-tree budget") has the
measurements and the command that repeats them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..backends.base import TreeLM
from ..ends import row_ends
from ..proposals.retrieval import DraftTree, RetrievalDrafter
from ..results import Generation
from ..verification import inverse_cdf
from .registry import RunContext, register

DEFAULT_BUDGET = 64  # draft-tree nodes per step, the reference's max_num_draft


@dataclass
class RacerRun:
    """Token ids per request and how far the drafts carried."""

    token_ids: list[list[int]]
    steps: int  # tree verifications (row-steps summed over requests)
    accepted: int  # drafted tokens accepted (roots and bonus tokens excluded)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per verification of one request (accepted drafts + 1)."""
        return 1.0 + self.accepted / max(1, self.steps)


def _pack(trees: Sequence[DraftTree], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Trees -> ``tokens, parents, valid`` ``[R, T]`` (padding nodes are invalid roots)."""
    t = max(len(tr) for tr in trees)
    tokens = torch.zeros(len(trees), t, dtype=torch.long)
    parents = torch.full((len(trees), t), -1, dtype=torch.long)
    valid = torch.zeros(len(trees), t, dtype=torch.bool)
    for i, tr in enumerate(trees):
        tokens[i, : len(tr)] = torch.tensor(tr.tokens)
        parents[i, : len(tr)] = torch.tensor(tr.parents)
        valid[i, : len(tr)] = True
    return tokens.to(device), parents.to(device), valid.to(device)


@dataclass
class _Requests:
    """Every request's output, its whole context (prompt + output) and its retrieval document."""

    outs: list[list[int]]
    contexts: list[list[int]]
    docs: list
    eos: set[int]
    max_new_tokens: int

    def going(self, req: int) -> bool:
        """Request ``req`` has neither ended nor spent its budget."""
        out = self.outs[req]
        return not row_ends(out[-1], len(out), self.max_new_tokens, self.eos)


def racer_generate(
    target: TreeLM,
    prompts: Sequence[Sequence[int]],
    drafter: RetrievalDrafter,
    *,
    eos_token_ids: Sequence[int],
    max_new_tokens: int,
    budget: int = DEFAULT_BUDGET,
    sampling: tuple[float, torch.Generator] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> RacerRun:
    """Generate with RACER drafting, all prompts batched; greedy unless ``sampling`` is given.

    ``sampling``: (T_t, the generator the uniforms come from). The output is then an exact
    sample of softmax(l / T_t): every node at output position t draws with the request's
    uniform for t, and only the draws along the walked path count, so the output is the one
    autoregressive inverse-CDF sampling with those uniforms gives, whatever the trees.
    """
    temperature, g = sampling if sampling is not None else (0.0, None)
    if sampling is not None and temperature <= 0:
        raise ValueError(f"a sampling temperature must be > 0, got {temperature}")
    uniforms = None
    if temperature > 0:  # [B, max_new_tokens]: one per request and output position
        uniforms = torch.rand(len(prompts), max_new_tokens, generator=g, device=g.device).to(target.device)
    reqs = _start(target, prompts, drafter, temperature, uniforms, eos_token_ids, max_new_tokens)
    rows = [i for i in range(len(prompts)) if reqs.going(i)]
    if len(rows) < len(prompts) and rows:
        target.fork(torch.tensor(rows))
    steps, accepted = 0, 0
    while rows:
        trees = [
            drafter.build_draft_tree(reqs.contexts[r], budget, max_new_tokens - len(reqs.outs[r]) - 1)
            for r in rows
        ]
        u = _node_uniforms(uniforms, trees, [len(reqs.outs[r]) for r in rows], rows)
        news = _verify_trees(target, drafter, trees, temperature, u)
        for req, new in zip(rows, news):
            steps, accepted = steps + 1, accepted + _emit(reqs, drafter, req, new)
        going = [i for i, req in enumerate(rows) if reqs.going(req)]
        if going and len(going) < len(rows):
            target.fork(torch.tensor(going))
        rows = [rows[i] for i in going]
        if on_step is not None:
            on_step(max(len(o) for o in reqs.outs))
    return RacerRun(reqs.outs, steps, accepted)


def _choose(logits: torch.Tensor, temperature: float, u: torch.Tensor | None) -> torch.Tensor:
    """Argmax at temperature 0, else the inverse CDF of softmax(logits / T) at ``u`` (``[N, V] -> [N]``)."""
    if temperature == 0:
        return logits.argmax(-1)
    return inverse_cdf(torch.softmax(logits.float() / temperature, -1), u)


def _node_uniforms(uniforms, trees, emitted, rows) -> torch.Tensor | None:
    """Each node's uniform ``[R, T]``: its request's, at the output position its choice fills."""
    if uniforms is None:
        return None
    t = max(len(tr) for tr in trees)
    positions = torch.zeros(len(trees), t, dtype=torch.long)
    for i, (tr, n) in enumerate(zip(trees, emitted)):
        positions[i, : len(tr)] = torch.tensor(tr.depth) + n
    positions = positions.clamp_(max=uniforms.shape[1] - 1).to(uniforms.device)
    return uniforms[torch.tensor(rows, device=uniforms.device)[:, None], positions]


def _start(target, prompts, drafter, temperature, uniforms, eos_token_ids, max_new_tokens) -> _Requests:
    """Prefill, draw every request's first token, and index the prompts."""
    logits = target.prefill(prompts)  # [B, V]
    drafter.cues.update(torch.tensor([p[-1] for p in prompts]), logits)
    first = _choose(logits, temperature, None if uniforms is None else uniforms[:, 0]).tolist()
    contexts = [list(p) + [x] for p, x in zip(prompts, first)]
    docs = [drafter.index.feed([], c) for c in contexts]
    eos = set(int(e) for e in eos_token_ids)
    return _Requests([[x] for x in first], contexts, docs, eos, max_new_tokens)


def _verify_trees(target, drafter, trees, temperature, u) -> list[list[int]]:
    """Score every tree in one target forward, walk it, keep the walked path in the cache.

    ``u [R, T]`` is each node's uniform (None: greedy). Returns, per row, the accepted
    drafted tokens and then the target's own next token.
    """
    tokens, parents, valid = _pack(trees, target.device)
    logits = target.extend_tree(tokens, parents, valid)  # [R, T, V]
    flat_u = None if u is None else u.flatten()
    choice = _choose(logits.flatten(0, 1), temperature, flat_u).view(tokens.shape)
    top = torch.topk(logits, drafter.cues.k, dim=-1).indices  # [R, T, k]
    keep = torch.zeros_like(valid)
    news = []
    for i, (tree, ch) in enumerate(zip(trees, choice.tolist())):
        path = [0]
        while (child := tree.children[path[-1]].get(ch[path[-1]])) is not None:
            path.append(child)
        keep[i, path] = True
        news.append([tree.tokens[j] for j in path[1:]] + [ch[path[-1]]])
    target.keep_path(keep)
    # Every node's cues are recorded (as in RACER); the accepted path's last, so cues
    # seen in the true context win over those of rejected branches.
    drafter.cues.record(tokens[valid], top[valid])
    drafter.cues.record(tokens[keep], top[keep])
    return news


def _emit(reqs: _Requests, drafter: RetrievalDrafter, req: int, new: list[int]) -> int:
    """Append ``new`` to request ``req`` up to an EOS or the budget; returns the drafts it accepted."""
    out, start = reqs.outs[req], len(reqs.outs[req])
    for t in new:
        out.append(t)
        if t in reqs.eos or len(out) >= reqs.max_new_tokens:
            break
    added = out[start:]
    reqs.contexts[req].extend(added)
    reqs.docs[req] = drafter.index.feed(reqs.docs[req], added)
    return min(len(added), len(new) - 1)


def _run(ctx: RunContext, temperature: float) -> list[Generation]:
    if not isinstance(ctx.target_lm, TreeLM):
        raise ValueError(
            f"RACER verifies token trees, which {type(ctx.target_lm).__name__} cannot; use the HF backend"
        )
    g = torch.Generator(device=ctx.target_lm.device).manual_seed(ctx.config.seed)
    run = racer_generate(
        ctx.target_lm,
        ctx.prompts,
        ctx.retrieval or RetrievalDrafter(ctx.target_lm.vocab_size),
        eos_token_ids=ctx.eos,
        max_new_tokens=ctx.config.max_new_tokens,
        sampling=(temperature, g) if temperature > 0 else None,
        on_step=ctx.on_progress,
    )
    return ctx.generations(run.token_ids)


@register("racer", uses_draft=False)
def _racer(ctx: RunContext) -> list[Generation]:
    return _run(ctx, 0.0)


@register(
    "racer_sampling",
    uses_draft=False,
    samples_target=True,
)
def _racer_sampling(ctx: RunContext) -> list[Generation]:
    return _run(ctx, ctx.config.target_temperature)

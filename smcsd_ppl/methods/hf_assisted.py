"""Hugging Face assisted generation and prompt lookup decoding: external peers (REFERENCE.md §7).

``target.generate(ids, assistant_model=draft, do_sample=True, ...)`` is exact speculative
sampling, batch 1 only, so requests run one after another. Configured as a fair peer:

* ``num_assistant_tokens`` = K, ``assistant_confidence_threshold`` = 0 (no early stop) and
  ``num_assistant_tokens_schedule = "constant"`` are set on the ASSISTANT's
  generation_config (``generate()`` ignores them as arguments), restored afterwards;
* ``top_k=0``, ``top_p=1`` keep the plain tempered target (the default top_k=50 changes it).

Unlike ``sd``, the assistant samples at the target's temperature T_t (HF drafts with a
copy of the target's generation config), so ``SMCConfig.draft_temperature`` is unused.
A layer-slice draft (shared modules) works: the assistant keeps its own KV cache, and
its layers' ``layer_idx`` are 0..n-1 as in the target's cache.

``generate()`` bypasses the backends, so forward hooks on both models count calls,
seconds and tokens into ``pair.target_lm.stats`` / ``pair.draft_lm.stats``; ``RunStats``
(target calls, tokens per target call) then stays right.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
from transformers import PreTrainedModel

from ..backends.base import ForwardStats
from ..results import Generation
from .hf import plain_sampling
from .registry import register


@contextmanager
def count_forwards(model: torch.nn.Module, stats: ForwardStats) -> Iterator[None]:
    """Add calls, wall seconds and fed tokens of ``model``'s top-level forwards to ``stats``."""
    device = next(model.parameters()).device
    starts: list[float] = []

    def before(module, args, kwargs):
        starts.append(time.perf_counter())
        ids = kwargs.get("input_ids", args[0] if args else None)
        stats.tokens += int(ids.numel()) if isinstance(ids, torch.Tensor) else 0

    def after(module, args, kwargs, output):
        if device.type == "cuda":  # as backends.base.Timer: time the kernels, not the launch
            torch.cuda.synchronize(device)
        stats.calls += 1
        stats.seconds += time.perf_counter() - starts.pop()

    hooks = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def assistant_settings(assistant: PreTrainedModel, k: int) -> Iterator[None]:
    """Give ``assistant`` a generation_config drafting exactly K tokens per round.

    The original config object is put back afterwards, even on error; HF writes the
    heuristic schedule's state into the assistant's config, which we never keep.
    """
    saved = assistant.generation_config
    cfg = copy.deepcopy(saved)
    cfg.num_assistant_tokens = k
    cfg.assistant_confidence_threshold = 0.0  # 0 disables HF's early stop on low draft confidence
    cfg.num_assistant_tokens_schedule = "constant"
    assistant.generation_config = cfg
    try:
        yield
    finally:
        assistant.generation_config = saved


@contextmanager
def _no_default_eos(model: PreTrainedModel, *, drop: bool) -> Iterator[None]:
    saved = model.generation_config
    if drop:
        model.generation_config = copy.deepcopy(saved)
        model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config = saved


def hf_speculative(
    target: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    block_size: int,
    max_new_tokens: int,
    temperature: float,
    eos_token_ids: Sequence[int],
    seed: int,
    assistant: PreTrainedModel | None = None,
    target_stats: ForwardStats | None = None,
    draft_stats: ForwardStats | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """HF assisted generation (with ``assistant``) or prompt lookup (without), per prompt.

    Args:
        target: the HF causal LM sampled from.
        prompts: token ids, one request each (HF assisted generation is batch 1).
        block_size: K, tokens the assistant drafts (or prompt lookup copies) per round.
        max_new_tokens: budget per request.
        temperature: T_t of the target (and of the assistant: HF drafts with the target's).
        eos_token_ids: stop ids; empty means run to ``max_new_tokens``.
        seed: seeds torch's global generator, which HF samples from; the caller's
            global RNG state is restored afterwards.
        assistant: the draft LM (same vocabulary); None for prompt lookup decoding.
        target_stats: forward counter of the target to add to.
        draft_stats: forward counter of the assistant to add to.
        on_step: called with the longest output length after each request.

    Returns:
        New token ids per prompt (an ending EOS included).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = next(target.parameters()).device
    eos = [int(e) for e in eos_token_ids]
    pad = eos[0] if eos else target.generation_config.pad_token_id or 0
    if assistant is not None:
        mode = {"assistant_model": assistant}
    else:
        mode = {"prompt_lookup_num_tokens": block_size}
    outs: list[list[int]] = []
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
        # generate() falls back to the model's own EOS when given none: hide it to run on.
        stack.enter_context(_no_default_eos(target, drop=not eos))
        if target_stats is not None:
            stack.enter_context(count_forwards(target, target_stats))
        if assistant is not None:
            stack.enter_context(assistant_settings(assistant, block_size))
            if draft_stats is not None:
                stack.enter_context(count_forwards(assistant, draft_stats))
        torch.manual_seed(seed)
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], device=device)
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **plain_sampling(temperature, max_new_tokens),
                eos_token_id=eos or None,
                pad_token_id=pad,
                **mode,
            )
            outs.append(out[0, ids.shape[1] :].tolist())
            if on_step is not None:
                on_step(max(len(o) for o in outs))
    return outs


def _run(pair, ids, config, on_progress, *, assisted: bool) -> list[Generation]:
    name = "hf_assisted" if assisted else "hf_prompt_lookup"
    if config.alpha != 1.0:
        raise ValueError(f"{name} samples the target itself: alpha must be 1")
    if assisted and getattr(pair.draft.model, "reads_hidden", False):
        raise ValueError(
            f"{name} needs a standalone draft model; {pair.draft.name!r} reads the target's hidden "
            "states, which Hugging Face's assistant interface cannot pass (use --draft layers:N)"
        )
    tokens = hf_speculative(
        pair.target.model,
        ids,
        assistant=pair.draft.model if assisted else None,
        block_size=config.block_size,
        max_new_tokens=config.max_new_tokens,
        temperature=config.target_temperature,
        eos_token_ids=pair.eos_for(config),
        seed=config.seed,
        target_stats=pair.target_lm.stats,
        draft_stats=pair.draft_lm.stats if assisted else None,
        on_step=on_progress,
    )
    return [Generation(pair.decode(t), t, name, None) for t in tokens]


@register("hf_assisted", summary="Hugging Face assisted generation (exact SD, batch 1, draft at T_t)")
def _hf_assisted(pair, ids, config, on_progress):
    return _run(pair, ids, config, on_progress, assisted=True)


@register("hf_prompt_lookup", uses_draft=False, summary="Hugging Face prompt lookup decoding (batch 1)")
def _hf_prompt_lookup(pair, ids, config, on_progress):
    return _run(pair, ids, config, on_progress, assisted=False)

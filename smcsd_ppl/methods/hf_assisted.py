"""Hugging Face assisted generation and prompt lookup decoding: external peers.

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
seconds and tokens into the backends' ``stats``; ``RunStats`` (target calls, tokens
per target call) then stays right.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial

import torch
from transformers import PreTrainedModel

from ..backends.base import ForwardStats, Timer
from ..config import SMCConfig
from ..results import Generation
from .hf import plain_sampling
from .registry import RunContext, register


@contextmanager
def count_forwards(model: torch.nn.Module, stats: ForwardStats) -> Iterator[None]:
    """Add calls, fed tokens and time of ``model``'s forwards to ``stats`` (a ``Timer`` each: no syncs)."""
    device = next(model.parameters()).device
    open_timers: list[Timer] = []

    def before(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = int(ids.numel()) if isinstance(ids, torch.Tensor) else 0
        open_timers.append(Timer(stats, device, tokens).__enter__())

    def after(module, args, kwargs, output):
        open_timers.pop().__exit__(None, None, None)

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
    config: SMCConfig,
    eos_token_ids: Sequence[int],
    *,
    assistant: PreTrainedModel | None = None,
    stats: tuple[ForwardStats | None, ForwardStats | None] = (None, None),
    on_step: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """HF assisted generation (with ``assistant``) or prompt lookup (without), per prompt.

    Args:
        target: the HF causal LM sampled from.
        prompts: token ids, one request each (HF assisted generation is batch 1).
        config: K (tokens the assistant drafts, or prompt lookup copies, per round), the
            budget per request, T_t (the assistant's too: HF drafts with the target's) and the
            seed of torch's global generator, which HF samples from (the caller's global RNG
            state is restored afterwards).
        eos_token_ids: stop ids; empty means run to ``max_new_tokens``.
        assistant: the draft LM (same vocabulary); None for prompt lookup decoding.
        stats: forward counters of the target and of the assistant to add to.
        on_step: called with the longest output length after each request.

    Returns:
        New token ids per prompt (an ending EOS included).
    """
    k, temperature = config.block_size, config.target_temperature
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    eos = [int(e) for e in eos_token_ids]
    settings = _generate_settings(target, assistant, k, config.max_new_tokens, temperature, eos)
    outs: list[list[int]] = []
    with _generation_scope(target, assistant, k, not eos, *stats):
        torch.manual_seed(config.seed)
        for prompt in prompts:
            outs.append(_generate_one(target, prompt, settings))
            if on_step is not None:
                on_step(max(len(o) for o in outs))
    return outs


def _generate_settings(target, assistant, block_size, max_new_tokens, temperature, eos: list[int]) -> dict:
    """``generate()`` arguments: plain sampling, our EOS, and assisted or prompt-lookup drafting."""
    if assistant is not None:
        mode = {"assistant_model": assistant}
    else:
        mode = {"prompt_lookup_num_tokens": block_size}
    return dict(
        **plain_sampling(temperature, max_new_tokens),
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else target.generation_config.pad_token_id or 0,
        **mode,
    )


@contextmanager
def _generation_scope(target, assistant, block_size, drop_eos, target_stats, draft_stats) -> Iterator[None]:
    """The caller's RNG kept, forwards counted, the assistant drafting K tokens, EOS as asked."""
    device = next(target.parameters()).device
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
        # generate() falls back to the model's own EOS when given none: hide it to run on.
        stack.enter_context(_no_default_eos(target, drop=drop_eos))
        if target_stats is not None:
            stack.enter_context(count_forwards(target, target_stats))
        if assistant is not None:
            stack.enter_context(assistant_settings(assistant, block_size))
            if draft_stats is not None:
                stack.enter_context(count_forwards(assistant, draft_stats))
        yield


def _generate_one(target: PreTrainedModel, prompt: Sequence[int], settings: dict) -> list[int]:
    """New token ids of one ``generate()`` call on ``prompt``."""
    ids = torch.tensor([list(prompt)], device=next(target.parameters()).device)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **settings)
    return out[0, ids.shape[1] :].tolist()


def _run(ctx: RunContext, *, assisted: bool) -> list[Generation]:
    target, draft = ctx.built_models("hf_assisted" if assisted else "hf_prompt_lookup")
    if assisted and getattr(draft.model, "reads_hidden", False):
        raise ValueError(
            f"hf_assisted needs a standalone draft model; {draft.name!r} reads the target's hidden "
            "states, which Hugging Face's assistant interface cannot pass (use --draft layers:N)"
        )
    tokens = hf_speculative(
        target.model,
        ctx.prompts,
        ctx.config,
        ctx.eos,
        assistant=draft.model if assisted else None,
        stats=(ctx.target_lm.stats, ctx.draft_lm.stats if assisted else None),
        on_step=ctx.on_progress,
    )
    return ctx.generations(tokens)


def _register(name: str, *, assisted: bool) -> None:
    """Register one of the two ``generate()`` modes; only the assisted one feeds the draft."""
    register(name, uses_draft=assisted, samples_target=True)(partial(_run, assisted=assisted))


_register("hf_assisted", assisted=True)
_register("hf_prompt_lookup", assisted=False)

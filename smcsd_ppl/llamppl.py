"""LLaMPPL programs on SMC-SD's engine: change the import, keep the program.

``smcsd_ppl.llamppl`` offers every public name of ``llamppl`` (see ``LLAMPPL_NAMES``). A
program imports them from here instead and runs on this library's batched row store, where
every particle's token-level step of a cycle shares one target forward and
``await self.extend()`` adds SMC-SD blocks (K drafted tokens per target forward)::

    from smcsd_ppl.llamppl import CachedCausalLM, LMContext, Model, smc_standard

    class Program(Model):
        def __init__(self, lm, prompt):
            super().__init__()
            self.context = LMContext(lm, prompt)

        async def step(self):
            token = await self.sample(self.context.next_token())
            if token == self.context.lm.tokenizer.eos_token_id:
                self.finish()

    lm = CachedCausalLM.from_pretrained(None)  # the embedded default (or a hub id)
    particles = asyncio.run(smc_standard(Program(lm, "Once upon a time"), 8))

``CachedCausalLM``, ``LMContext``, ``Model``, ``smc_standard`` and ``smc_steer`` are this
library's; every other name is ``llamppl``'s own object, which runs unchanged on these
programs. docs/from-llamppl.md lists what differs, name by name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import types
from collections.abc import Sequence

import llamppl
import numpy as np
import torch
from llamppl import (
    MLX_AVAILABLE,
    VLLM_AVAILABLE,
    AsyncMlxLM,
    AsyncTransformer,
    AsyncVirtualLM,
    Bernoulli,
    Distribution,
    Geometric,
    LogCategorical,
    Masks,
    MockAsyncLM,
    SubModel,
    Token,
    TokenCategorical,
    TokenSequence,
    Transformer,
    log_softmax,
    logsumexp,
    sample_word,
    sample_word_2,
    softmax,
    submodel,
)

from .api import SMCSD
from .config import SMCConfig
from .inference.context import LMContext
from .inference.program import SMCSDModel as Model
from .inference.record import Recorder, write_record
from .inference.state import final_particles
from .inference.steer import Steering

__all__ = [  # this library's five, then llamppl's own objects
    "CachedCausalLM",
    "LMContext",
    "Model",
    "smc_standard",
    "smc_steer",
    "AsyncMlxLM",
    "AsyncTransformer",
    "AsyncVirtualLM",
    "Bernoulli",
    "Distribution",
    "Geometric",
    "LogCategorical",
    "MLX_AVAILABLE",
    "Masks",
    "MockAsyncLM",
    "SubModel",
    "Token",
    "TokenCategorical",
    "TokenSequence",
    "Transformer",
    "VLLM_AVAILABLE",
    "log_softmax",
    "logsumexp",
    "sample_word",
    "sample_word_2",
    "softmax",
    "submodel",
]


def llamppl_public_names(module=None) -> set[str]:
    """``llamppl``'s public names (it has no ``__all__``).

    What ``dir(llamppl)`` shows, less underscore names, modules, and objects defined by
    packages other than llamppl and genlm (the ones it merely imports, such as ``defaultdict``).
    """
    module = module or llamppl
    out = set()
    for name in dir(module):
        value = getattr(module, name)
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        origin = getattr(value, "__module__", None)
        if origin is None or origin.split(".")[0] in ("llamppl", "genlm"):
            out.add(name)
    return out


class CachedCausalLM:
    """A pair's target as LLaMPPL's language model: vocabulary, masks, tokenizer, log-probabilities.

    Args:
        pair: an ``SMCSD`` pair (or any object with its ``rows()``, ``lock``, ``tokenizer``,
            ``eos_token_ids``, ``decode`` and ``target_lm``).
    """

    def __init__(self, pair) -> None:
        if not hasattr(pair, "rows"):
            raise ValueError(
                f"CachedCausalLM here wraps an SMCSD pair, not a {type(pair).__name__}: "
                "use CachedCausalLM.from_pretrained(model_id) or CachedCausalLM(SMCSD(...))"
            )
        self.pair = pair
        self.tokenizer = pair.tokenizer
        self.backend = "hf"
        self.batch_size = None  # LLaMPPL's auto-batch size: here every cycle is one batch
        self.running = False  # a run holds the pair's rows
        self.str_vocab, self.byte_vocab = _vocabularies(self.tokenizer, pair.target_lm.vocab_size)
        self.masks = Masks(self)

    @classmethod
    def from_pretrained(cls, model_id: str | None = None, draft: str | None = None, **kwargs):
        """Load a target (a hub id, a local path, None for the embedded default) and its draft."""
        return cls(SMCSD.load(model_id, draft, chat=False, **kwargs))

    @property
    def model(self):
        """Refused: there is no genlm ``AsyncLM`` here."""
        raise ValueError(
            "CachedCausalLM.model does not exist here: the models are lm.pair.target_lm and draft_lm"
        )

    @property
    def vocab(self) -> list[str]:
        """LLaMPPL's old name of ``str_vocab``."""
        return self.str_vocab

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a prompt, as given (no chat template)."""
        return list(self.tokenizer.encode(prompt))

    def next_token_logprobs_unbatched(self, token_ids: Sequence[int]) -> np.ndarray:
        """Log-probabilities (float32 ``[V]``) of the token after ``token_ids``, outside a run."""
        if self.running:
            raise ValueError(
                "lm.next_token_logprobs cannot run inside a program's step here: "
                "use context.next_token() or context.mask_dist() (batched with the other particles)"
            )
        ids = [[int(t) for t in token_ids]]
        logits = self.pair.call(lambda: self.pair.target_lm.prefill(ids)[0])
        return torch.log_softmax(logits.float(), -1).cpu().numpy()

    async def next_token_logprobs(self, token_ids: Sequence[int]) -> np.ndarray:
        """As ``next_token_logprobs_unbatched`` (one forward, not batched)."""
        return self.next_token_logprobs_unbatched(token_ids)

    def cache_kv(self, prompt_tokens: Sequence[int]) -> None:
        """Accepted: every context's prompt is prefilled once per run anyway."""

    def clear_cache(self) -> None:
        """Accepted: a run keeps no cache after it ends."""

    def clear_kv_cache(self) -> None:
        """Accepted: a run keeps no cache after it ends."""

    def reset_async_queries(self) -> None:
        """Accepted: no query outlives a run."""

    def __deepcopy__(self, memo: dict) -> CachedCausalLM:
        return self


def _vocabularies(tokenizer, size: int) -> tuple[list[str], list]:
    """The tokens' text and bytes, decoded as genlm-backend decodes them for LLaMPPL."""
    try:
        from genlm.backend.tokenization import decode_vocab

        byte_vocab, str_vocab = decode_vocab(tokenizer)
    except Exception:  # a tokenizer genlm cannot read (a test's mock): decode token by token
        str_vocab = tokenizer.batch_decode([[i] for i in range(size)], clean_up_tokenization_spaces=False)
        byte_vocab = [s.encode() for s in str_vocab]
    return list(str_vocab), list(byte_vocab)


def _lm_of(model: Model) -> CachedCausalLM:
    for ctx in model.contexts():
        if isinstance(ctx.lm, CachedCausalLM):
            return ctx.lm
    raise ValueError(
        f"{type(model).__name__} has no LMContext built on a smcsd_ppl.llamppl.CachedCausalLM: "
        "build its contexts with LMContext(lm, prompt), lm = CachedCausalLM.from_pretrained(...)"
    )


def _config(n_particles: int, ess_threshold: float, settings: dict) -> SMCConfig:
    defaults = dict(target_temperature=1.0, draft_temperature=1.0, max_new_tokens=256)
    return SMCConfig(**(defaults | settings | dict(n_particles=n_particles, ess_threshold=ess_threshold)))


async def smc_standard(
    model: Model,
    n_particles: int,
    ess_threshold: float = 0.5,
    visualization_dir=None,
    json_file=None,
    **settings,
) -> list[Model]:
    """LLaMPPL's ``smc_standard`` on the batched engine: the final particles, with their weights.

    ``json_file`` (inside ``visualization_dir`` when given) receives LLaMPPL's SMC record.
    ``settings`` are ``SMCConfig`` fields (defaults: temperatures 1 as in LLaMPPL, resampling
    ``systematic``, ``max_new_tokens=256``, ``seed=0``, the quality cut on for blocks);
    ``resampling_method`` is LLaMPPL's name of ``resampling``. ``target_temperature`` tempers
    blocks and contexts built without a language model; ``LMContext(lm, prompt, temp)`` keeps
    its own ``temp`` (1 by default, as in LLaMPPL).
    """
    if "resampling_method" in settings:
        settings["resampling"] = settings.pop("resampling_method")
    lm = _lm_of(model)
    config = _config(n_particles, ess_threshold, settings)
    keep = json_file is not None or visualization_dir is not None
    recorder = Recorder(config.n_particles) if keep else None
    particles = await _run(lm, model, config, on_cycle=recorder)
    if keep:
        write_record(recorder.history, model, visualization_dir, json_file)
    return particles


async def _run(lm: CachedCausalLM, model: Model, config: SMCConfig, **kwargs) -> list[Model]:
    """One program to the end as a request of the pair's engine: its final particles, with their weights.

    ``kwargs``: ``on_cycle`` (called after each of its cycles) and ``reshape``, as ``Engine.run``'s.
    """

    def run() -> list[Model]:
        lm.running = True
        try:
            [ticket] = lm.pair.engine.run(
                [model], config, observer=kwargs.get("on_cycle"), reshape=kwargs.get("reshape")
            )
        finally:
            lm.running = False
        return final_particles(ticket.population)

    return await asyncio.to_thread(run)


async def smc_steer(model: Model, n_particles: int, n_beam: int, **settings) -> list[Model]:
    """LLaMPPL's ``smc_steer`` on the batched engine: N particles, ``n_beam`` children each, N kept.

    Each round every unfinished particle steps as ``n_beam`` copies; LLaMPPL's without-replacement
    resampling then keeps N of the children (the heaviest surely, the rest by stratified draws).
    ``settings`` are ``SMCConfig`` fields, as in ``smc_standard``; the quality cut is off (it
    would resize the population) and ``seed`` also seeds the stratified draws.
    """
    if n_particles < 1 or n_beam < 1:
        raise ValueError(f"smc_steer needs n_particles >= 1 and n_beam >= 1, got {n_particles}, {n_beam}")
    lm = _lm_of(model)
    config = dataclasses.replace(_config(n_particles, 0.0, settings), cut=None)
    return await _run(lm, model, config, reshape=Steering(n_particles, n_beam, config.seed))

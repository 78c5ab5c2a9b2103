"""LLaMPPL programs on SMC-SD's engine: change the import, keep the program.

A LLaMPPL program imports ``CachedCausalLM``, ``LMContext``, ``Model`` and ``smc_standard``
from ``llamppl``; importing them from here instead runs it on this library's batched row
store, where every particle's token-level step of a cycle shares one target forward and
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

What differs from LLaMPPL: prompts are encoded as given (no chat template, as LLaMPPL
does); a context's temperature defaults to 1 as there; ``max_new_tokens`` bounds every
context; ``smc_standard``'s visualization and JSON-record arguments are accepted and
ignored; and ``smc_steer`` (beam search) is not offered: use ``smc_standard``.
"""

from __future__ import annotations

from collections.abc import Sequence

import llamppl.llms

from .api import SMCSD
from .config import SMCConfig
from .inference.context import LMContext
from .inference.loop import run_to_end
from .inference.program import SMCSDModel as Model
from .inference.state import final_particles

__all__ = ["CachedCausalLM", "LMContext", "Model", "smc_standard", "smc_steer"]


class CachedCausalLM:
    """A pair's target as LLaMPPL's language model: vocabulary, masks, tokenizer.

    Args:
        pair: an ``SMCSD`` pair (or any object with its ``rows()``, ``lock``, ``tokenizer``,
            ``eos_token_ids``, ``decode`` and ``target_lm``).
    """

    def __init__(self, pair) -> None:
        self.pair = pair
        self.tokenizer = pair.tokenizer
        self.backend = "hf"
        self.batch_size = None  # LLaMPPL's auto-batch size: here every cycle is one batch
        ids = [[i] for i in range(pair.target_lm.vocab_size)]
        self.str_vocab = self.tokenizer.batch_decode(ids, clean_up_tokenization_spaces=False)
        self.byte_vocab = [s.encode() for s in self.str_vocab]
        self.masks = llamppl.llms.Masks(self)

    @classmethod
    def from_pretrained(cls, model_id: str | None = None, draft: str | None = None, **kwargs):
        """Load a target (a hub id, a local path, None for the embedded default) and its draft."""
        return cls(SMCSD.load(model_id, draft, chat=False, **kwargs))

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a prompt, as given (no chat template)."""
        return list(self.tokenizer.encode(prompt))

    def cache_kv(self, prompt_tokens: Sequence[int]) -> None:
        """Accepted for LLaMPPL's programs: every context's prompt is prefilled once per run anyway."""

    def clear_cache(self) -> None:
        """Accepted for LLaMPPL's programs: a run keeps no cache after it ends."""


def _lm_of(model: Model) -> CachedCausalLM:
    for ctx in model.contexts():
        if isinstance(ctx.lm, CachedCausalLM):
            return ctx.lm
    raise ValueError(
        f"{type(model).__name__} has no LMContext built on a smcsd_ppl.llamppl.CachedCausalLM: "
        "build its contexts with LMContext(lm, prompt), lm = CachedCausalLM.from_pretrained(...)"
    )


async def smc_standard(
    model: Model,
    n_particles: int,
    ess_threshold: float = 0.5,
    visualization_dir=None,
    json_file=None,
    **settings,
) -> list[Model]:
    """LLaMPPL's ``smc_standard`` on the batched engine: the final particles, with their weights.

    ``settings`` are ``SMCConfig`` fields (defaults: temperatures 1 as in LLaMPPL, resampling
    ``systematic``, ``max_new_tokens=256``, ``seed=0``, the quality cut on for blocks).
    """
    lm = _lm_of(model)
    pair = lm.pair
    defaults = dict(target_temperature=1.0, draft_temperature=1.0, max_new_tokens=256)
    config = SMCConfig(**(defaults | settings | dict(n_particles=n_particles, ess_threshold=ess_threshold)))
    eos = [] if config.ignore_eos else list(pair.eos_token_ids)
    with pair.lock:
        store = pair.rows()
        _, state = await run_to_end([model], store, config, eos, pair.draft_record, lm.encode, pair.decode)
    return final_particles(state.populations[0])


async def smc_steer(model: Model, n_particles: int, n_beam: int, *args, **kwargs):
    """Not offered: LLaMPPL's beam-search steering has no batched counterpart here."""
    raise ValueError("smc_steer is not offered on SMC-SD's engine: use smcsd_ppl.llamppl.smc_standard")

"""Token-level steps: LLaMPPL's ``LMContext`` on a row of the row store.

A context is one generation in progress: its prompt, the tokens generated so far, and the
tokens a ``mask_dist`` observation has left possible for the next one. Its row lives in the
batched backends; ``next_token()`` and ``mask_dist()`` read the target's next-token
distribution there, batched with every other particle's request of the cycle, and tokens a
step appends reach the row with the context's next request. Blocks (``SMCSDModel.extend``)
work on the same contexts, so one program may mix token-level steps and blocks.

The distributions follow LLaMPPL's semantics: sampling ``next_token()`` draws from the
target (restricted to the current mask) with no weight; observing a token adds its log
probability; ``mask_dist(mask)`` is the event "the next token lies in ``mask``", whose
observation adds its log probability and restricts the next token to it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from llamppl.distributions import Distribution
from llamppl.llms import Token

from .blocks import TokenRequest


class LMContext:
    """A generation in progress on one row of the models (LLaMPPL's ``LMContext``).

    Args:
        lm: the language model (an ``smcsd_ppl.llamppl.CachedCausalLM``, or None): the run's pair
            decides the models; this names the vocabulary of returned tokens.
        prompt: text (encoded by ``lm`` as given; without ``lm``, by the run's tokenizer with the
            chat template) or token ids.
        temp: temperature of the token-level steps (default 1 with an ``lm``, as in LLaMPPL;
            without one, the run's target temperature, which blocks always use).
        show_prompt: ``str(context)`` includes the prompt.
        show_eos: ``str(context)`` keeps a final EOS token's text.

    Attributes:
        prompt_ids: the prompt's token ids (from the start with an ``lm``, else once the run starts).
        generated: the tokens generated so far.
        row: the context's row in the row store (-1 before the run).
    """

    def __init__(self, lm=None, prompt=(), temp: float | None = None, show_prompt=False, show_eos=True):
        if temp is not None and not (isinstance(temp, (int, float)) and temp > 0):
            raise ValueError(f"temp must be a number > 0, got {temp!r}")
        if temp is None and lm is not None:
            temp = 1.0  # LLaMPPL's default for a context built on a language model
        self.lm, self.prompt, self.temp = lm, prompt, temp
        self.show_prompt, self.show_eos = show_prompt, show_eos
        self.prompt_ids: list[int] = _early_ids(lm, prompt)
        self.generated: list[int] = []
        self.row = -1
        self.mask: torch.Tensor | None = None  # [V] bool: what the next token may be (None: anything)
        self.unsent: list[int] = []  # appended since the row last heard from this context
        self.tilt: tuple[int, dict | None] = (-1, None)  # (at which length, the next block's tilts)
        self.runtime = None

    @classmethod
    async def create(cls, lm, prompt, temp=1.0, show_prompt=False, show_eos=True) -> LMContext:
        """LLaMPPL's asynchronous constructor: the same context as ``LMContext(...)``."""
        return cls(lm, prompt, temp, show_prompt, show_eos)

    def __deepcopy__(self, memo: dict) -> LMContext:
        copy = LMContext.__new__(LMContext)
        copy.__dict__.update(self.__dict__)
        copy.generated, copy.prompt_ids, copy.unsent = (
            list(self.generated),
            self.prompt_ids,
            list(self.unsent),
        )
        return copy  # lm, runtime and the mask tensor are shared: nothing mutates them in place

    # LLaMPPL's interface
    def next_token(self) -> NextToken:
        """The distribution of the next token; sampling or observing it appends the token."""
        return NextToken(self)

    def mask_dist(self, mask: Iterable[int] | torch.Tensor) -> TokenMask:
        """The event "the next token is in ``mask``" (a set of token ids, or a bool tensor [V])."""
        return TokenMask(self, mask)

    @property
    def tokens(self) -> list[int]:
        """The whole sequence: prompt and generated tokens."""
        return self.prompt_ids + self.generated

    @property
    def token_count(self) -> int:
        """Tokens generated so far."""
        return len(self.generated)

    @property
    def prompt_token_count(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_ids)

    @property
    def prompt_string_length(self) -> int:
        """Characters of the decoded prompt (``str`` cuts them when ``show_prompt`` is off)."""
        return len(self._tokenizer().decode(self.prompt_ids))

    @property
    def model_mask(self) -> set[int]:
        """Token ids the next token may still be (all, unless a ``mask_dist`` outcome restricts it)."""
        if self.mask is not None:
            return set(torch.nonzero(self.mask).flatten().tolist())
        vocab = getattr(self.lm, "str_vocab", None)
        if vocab is None:
            raise ValueError("model_mask needs the context's lm: build it as LMContext(lm, prompt)")
        return set(range(len(vocab)))

    @property
    def next_token_logprobs(self) -> np.ndarray:
        """Log-probabilities of the next token at ``temp``, within the current mask (numpy ``[V]``).

        Inside a step this reads the context's row at once, in a forward of its own (not
        batched with the other particles): prefer sampling or observing ``next_token()``.
        """
        if self.runtime is None:
            if not hasattr(self.lm, "next_token_logprobs_unbatched"):
                raise ValueError(
                    "next_token_logprobs needs the context's lm: build it as LMContext(lm, prompt)"
                )
            lp = self.lm.next_token_logprobs_unbatched(self.tokens) / self.temp
            return lp - np.logaddexp.reduce(lp)
        serve = self.runtime.barrier.handler
        if serve is None or self.row < 0:
            raise ValueError("next_token_logprobs is read inside a step here: use it from step()")
        lp = serve([TokenRequest(self.row, self.take_unsent(), self.temp)])[0]
        return (lp if self.mask is None else _renormalized(lp, self.mask)).numpy()

    def __str__(self) -> str:
        if _has_decode(self.lm):  # LLaMPPL's text: the whole sequence decoded, the prompt cut off
            text = self.lm.tokenizer.decode(self.tokens)
            text = text if self.show_prompt else text[self.prompt_string_length :]
            eos = self.lm.tokenizer.eos_token
            return text[: -len(eos)] if not self.show_eos and eos and text.endswith(eos) else text
        if self.runtime is None:
            return f"LMContext({self.prompt!r})"
        ids = self.generated
        if not self.show_eos and ids and ids[-1] in self.runtime.eos:
            ids = ids[:-1]
        text = self.runtime.decode(ids)
        return self.runtime.decode(self.prompt_ids) + text if self.show_prompt else text

    def _tokenizer(self):
        if not _has_decode(self.lm):
            raise ValueError("this needs the context's tokenizer: build it as LMContext(lm, prompt)")
        return self.lm.tokenizer

    # the engine's side
    def append(self, tokens: Sequence[int]) -> None:
        """Add tokens the row has not read yet (they travel with the next request)."""
        self.generated.extend(int(t) for t in tokens)
        self.unsent.extend(int(t) for t in tokens)
        self.mask = None

    def take_unsent(self) -> tuple[int, ...]:
        """The tokens to send with a request (the row reads them before serving it)."""
        out, self.unsent = tuple(self.unsent), []
        return out

    async def log_probs(self) -> torch.Tensor:
        """Log-probabilities of the next token ``[V]`` at the context's temperature, within its mask."""
        if self.runtime is None:
            raise ValueError(
                "this context is not bound to a run: run its program with SMCSD.run or "
                "smcsd_ppl.llamppl.smc_standard (llamppl.smc_standard cannot batch it)"
            )
        lp = await self.runtime.barrier.submit(TokenRequest(self.row, self.take_unsent(), self.temp))
        return lp if self.mask is None else _renormalized(lp, self.mask)

    def _mask_tensor(self, mask: Iterable[int] | torch.Tensor, size: int) -> torch.Tensor:
        if isinstance(mask, torch.Tensor):
            return mask.to(torch.bool).cpu()
        out = torch.zeros(size, dtype=torch.bool)
        ids = list(mask)
        if ids:
            out[torch.tensor(ids, dtype=torch.long)] = True
        return out

    def _token(self, token_id: int) -> Token:
        vocab = getattr(self.lm, "str_vocab", None)
        return Token(self.lm, token_id, vocab[token_id] if vocab else str(token_id))


def _has_decode(lm) -> bool:
    return hasattr(getattr(lm, "tokenizer", None), "decode")


def _early_ids(lm, prompt) -> list[int]:
    """The prompt's ids at construction, when the lm can encode it (else the run encodes it)."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    encode = getattr(lm, "encode", None)
    return list(encode(prompt)) if encode is not None else []


def _renormalized(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    kept = lp.masked_fill(~mask, -math.inf)
    return kept - torch.logsumexp(kept, 0)


@dataclass
class NextToken(Distribution):
    """The next token of a context: drawn from the target; observing one adds its log probability."""

    ctx: LMContext

    async def sample(self) -> tuple[Token, float]:
        """Draw the next token (LLaMPPL's ``sample`` adds no weight for it)."""
        lp = await self.ctx.log_probs()
        token = int(torch.multinomial(lp.exp(), 1, generator=self.ctx.runtime.generator))
        self.ctx.append([token])
        return self.ctx._token(token), float(lp[token])

    async def log_prob(self, x: Token | int) -> float:
        """Log probability of token ``x`` next; appends it (``observe`` and ``intervene``)."""
        token = int(x.token_id if isinstance(x, Token) else x)
        lp = await self.ctx.log_probs()
        self.ctx.append([token])
        return float(lp[token])


@dataclass
class TokenMask(Distribution):
    """Whether the next token of a context lies in a set; the outcome restricts that token."""

    ctx: LMContext
    tokens: Iterable[int] | torch.Tensor

    async def _split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lp = await self.ctx.log_probs()
        inside = self.ctx._mask_tensor(self.tokens, lp.shape[0])
        possible = torch.isfinite(lp)
        return lp, possible & inside, possible & ~inside

    async def sample(self) -> tuple[bool, float]:
        """Draw whether the next token lies in the set; restrict the next token accordingly."""
        lp, yes, no = await self._split()
        log_yes = float(torch.logsumexp(lp.masked_fill(~yes, -math.inf), 0))
        u = float(torch.rand(1, generator=self.ctx.runtime.generator))
        outcome = u < math.exp(log_yes)
        self.ctx.mask = yes if outcome else no
        return outcome, log_yes if outcome else math.log1p(-min(math.exp(log_yes), 1.0))

    async def log_prob(self, outcome: bool) -> float:
        """Log probability of the outcome; restricts the next token to it (-inf: impossible)."""
        lp, yes, no = await self._split()
        good = yes if outcome else no
        if not bool(good.any()):
            return -math.inf  # LLaMPPL's observe then sees a dead particle; the mask stays
        self.ctx.mask = good
        return float(torch.logsumexp(lp.masked_fill(~good, -math.inf), 0))

"""The pair core: two backends sharing a vocabulary, their one row store, text in and out, the checks.

Everything above it (the facade in ``api``, the engine, the HTTP server) reads a pair through
this record; nothing but the engine's thread moves its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..backends.base import BatchedLM
from ..backends.fixed import FixedShape
from ..config import DraftRecord, SMCConfig
from ..inference.rows import RowStore
from ..models import LoadedModel
from ..potentials.conditions import Conditions
from ..potentials.constraints import special_ids
from ..text import check_token_ids, encode_prompt, token_text, whole_characters


@dataclass(frozen=True)
class Execution:
    """How a pair's models run.

    Attributes:
        backend: what runs the models (``"hf"``, ``"vllm"``, or a test's name).
        forward: how the HF backend computes a forward (``config.FORWARDS``).
        deterministic: every forward a request takes part in has shapes of its own alone, so a
            seeded request's tokens do not depend on its batch-mates.
    """

    backend: str = "hf"
    forward: str = "auto"
    deterministic: bool = False


class PairCore:
    """A target and a draft backend with their one ``RowStore``, a tokenizer and the request checks.

    Args:
        target_lm: the target's batched backend.
        draft_lm: the draft's (same vocabulary, same device).
        tokenizer: the shared tokenizer (None: token-id prompts only, a decode given to ``over``).
        eos_token_ids: the target's EOS ids.
        chat: wrap text prompts in the tokenizer's chat template when it has one.
        target: the loaded target (None for backends built without PyTorch models).
        draft: the loaded draft, likewise.
        execution: the backend's name and how calls run (``Execution``).
    """

    def __init__(
        self,
        target_lm: BatchedLM,
        draft_lm: BatchedLM,
        *,
        tokenizer=None,
        eos_token_ids: Sequence[int] = (),
        chat: bool = True,
        target: LoadedModel | None = None,
        draft: LoadedModel | None = None,
        execution: Execution = Execution(),
    ) -> None:
        self.execution = execution
        self.backend, self.deterministic = execution.backend, execution.deterministic
        self.target_lm, self.draft_lm = target_lm, draft_lm
        self.store = RowStore(target_lm, draft_lm)  # the only one: every run's rows live here
        self.tokenizer, self.chat = tokenizer, chat
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self.target, self.draft = target, draft
        # A tokenizer's decode and encode, unless ``over`` was given its own (a mock's).
        self._decode: Callable[[Sequence[int]], str] | None = None
        self._encode: Callable[[str], list[int]] | None = None
        self._facts: PairFacts | None = None
        # What SMC-SD's adaptive drafting knows of this draft before a request: a value each
        # request starts from and none changes (assign a learned one to change it); a
        # distilled draft may ship one.
        self.draft_record = (draft.record if draft is not None else None) or DraftRecord()
        self._conditions: Conditions | None = None

    @classmethod
    def over(
        cls,
        store: RowStore,
        eos_token_ids: Sequence[int],
        *,
        decode: Callable[[Sequence[int]], str],
        encode: Callable[[str], list[int]] | None = None,
    ) -> PairCore:
        """A core over an existing row store (a custom loop's, a test's)."""
        core = cls(store.target, store.draft, eos_token_ids=eos_token_ids)
        core.store, core._decode, core._encode = store, decode, encode
        return core

    @property
    def encode(self) -> Callable[[str], list[int]] | None:
        """Text -> token ids (chat template applied for instruct models); None without a tokenizer."""
        if self._encode is not None or self.tokenizer is None:
            return self._encode
        return lambda prompt: encode_prompt(self.tokenizer, prompt, chat=self.chat)

    def with_draft(self, draft_lm: BatchedLM) -> PairCore:
        """This pair with another draft backend, over a new row store (and no draft record)."""
        core = PairCore(
            self.target_lm,
            draft_lm,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            chat=self.chat,
            target=self.target,
            draft=self.draft,
            execution=self.execution,
        )
        core.draft_record = DraftRecord()  # the loaded draft's record says nothing of another
        return core

    @property
    def row_limit(self) -> int | None:
        """The most rows a batch may hold, where the backends' forwards have fixed shapes (else None)."""
        lms = (self.target_lm, self.draft_lm)
        shapes = [lm.shape.rows for lm in lms if isinstance(getattr(lm, "shape", None), FixedShape)]
        return min(shapes, default=None)

    @property
    def forwards(self) -> list:
        """Our forwards of the pair's models (``backends.llama.LlamaForward``), where they run ours."""
        return [
            f for lm in (self.target_lm, self.draft_lm) if (f := getattr(lm, "compiled", None)) is not None
        ]

    def forward_note(self) -> str:
        """One line on how the models compute a forward, and what of ours is compiled."""
        if not self.forwards:
            return f"forward: the models' own ({self.backend} backend)"
        lms = (("target", self.target_lm), ("draft", self.draft_lm))
        roles = [role for role, lm in lms if getattr(lm, "compiled", None) is not None]
        f = self.forwards[0]
        return f"forward: ours for the {' and '.join(roles)}; {f.parts.describe(f.shape, f.device)}"

    def build_forwards(self, *, background: bool = False) -> None:
        """Compile the parts our forwards lack (kept on disk for later processes).

        ``background``: in a thread of their own; the forwards run uncompiled meanwhile and take
        each compiled part as it is ready (a server answers at once).
        """
        for f in self.forwards:
            f.parts.build(f.shape, f.device, background=background)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens dropped), up to its last whole character.

        The bytes of a character cut at the end are held back, as a stream holds them, so
        a result's text is what its stream joins into.
        """
        return whole_characters(self.decode_bytes(ids))

    @property
    def conditions(self) -> Conditions:
        """The programs' per-token conditions over this vocabulary (each test applied once)."""
        if self._conditions is None:
            self._conditions = Conditions(self._pieces, self.eos_token_ids)
        return self._conditions

    def _pieces(self) -> list[str | None]:
        """Each token's text, by id (None: a special token, which no condition lets through)."""
        special = special_ids(self.tokenizer) if self.tokenizer is not None else set()
        return [None if i in special else self.decode_bytes([i]) for i in range(self.target_lm.vocab_size)]

    def decode_bytes(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens dropped), U+FFFD where bytes are not yet a character."""
        if self._decode is not None:
            return self._decode(ids)
        return token_text(self.tokenizer, ids)

    def eos_for(self, config: SMCConfig) -> list[int]:
        """EOS ids in force under ``config`` (none with ``ignore_eos``)."""
        return [] if config.ignore_eos else list(self.eos_token_ids)

    @property
    def names(self) -> dict:
        """What a server tells of the pair: the models' names and the backend."""
        target = self.target.name if self.target is not None else getattr(self.target_lm, "name", "target")
        draft = self.draft.name if self.draft is not None else getattr(self.draft_lm, "name", "draft")
        return {"target": target, "draft": draft, "backend": self.backend}

    @property
    def facts(self) -> PairFacts:
        """What requests are checked against (a value another process can hold)."""
        if self._facts is None:
            model = None if self.target is None else self.target.model
            vocab = (
                self.target_lm.vocab_size if model is None else model.get_input_embeddings().num_embeddings
            )
            lms = (self.target_lm, self.draft_lm)
            limits = (ModelLimits.of(lm) for lm in lms)
            self._facts = PairFacts(vocab, tuple(self.eos_token_ids), *limits, scores=model is not None)
        return self._facts

    def check_token_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """Refuse a token-id prompt that is empty or holds ids outside the target's vocabulary."""
        self.facts.check_token_prompts(prompts)

    def check_fits(
        self, ids: Sequence[Sequence[int]], config: SMCConfig, uses_draft: bool, rows: int
    ) -> None:
        """Refuse up front what would fail mid-generation (context length, KV budget)."""
        self.facts.check_fits(ids, config, uses_draft, rows)

    def check_request(self, ids: Sequence[int], config: SMCConfig) -> None:
        """Refuse, in one line, an SMC-SD request's prompt: empty, off the vocabulary or too long."""
        self.facts.check_request(ids, config)


@dataclass(frozen=True)
class ModelLimits:
    """One model's limits: its context, and its KV cache's bytes per position and budget."""

    name: str
    max_length: int
    bytes_per_token: int
    max_cache_bytes: int

    @classmethod
    def of(cls, lm: BatchedLM) -> ModelLimits:
        """A backend's limits."""
        return cls(lm.name, lm.max_length, lm.bytes_per_token, lm.max_cache_bytes)


@dataclass(frozen=True)
class PairFacts:
    """What a request is checked against: the vocabulary, the EOS ids and both models' limits.

    ``scores``: the target is a PyTorch model, which gives a request's log-probabilities.
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    target: ModelLimits
    draft: ModelLimits
    scores: bool = False

    @property
    def kv_bytes_per_position(self) -> int:
        """KV-cache bytes one row holds per position, the target's and the draft's together."""
        return self.target.bytes_per_token + self.draft.bytes_per_token

    @property
    def kv_budget_bytes(self) -> int:
        """The most both KV caches may hold (each backend's ``max_cache_bytes``)."""
        return self.target.max_cache_bytes + self.draft.max_cache_bytes

    def kv_note(self, max_rows: int) -> str:
        """One line for an operator: what ``max_rows`` rows cost per 1,000 positions, and the cap."""
        per_k = self.kv_bytes_per_position * max_rows * 1000
        return (
            f"KV cache: {self.kv_bytes_per_position / 1024:.1f} KiB per row-position (target + draft); "
            f"{max_rows} rows hold {per_k / 1e9:.1f} GB per 1,000 positions each (a request's prompt + "
            f"max_new_tokens + K + 1), capped at {self.kv_budget_bytes / 2**30:.1f} GiB (max_cache_bytes)"
        )

    def check_token_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """Refuse a token-id prompt that is empty or holds ids outside the vocabulary."""
        for p in prompts:
            check_token_ids(p, self.vocab_size)

    def check_fits(
        self, ids: Sequence[Sequence[int]], config: SMCConfig, uses_draft: bool, rows: int
    ) -> None:
        """Refuse up front what would fail mid-generation (context length, KV budget).

        ``uses_draft``: the method feeds the draft (and may draft past the budget by a block);
        ``rows``: the rows the call holds at once.
        """
        config.sampling.check(self.vocab_size)  # a logit bias names tokens of this vocabulary
        prompt = max(len(i) for i in ids)
        if not uses_draft:  # the last sampled token is never fed
            longest, extra, lms = prompt + config.max_new_tokens - 1, "", [self.target]
        else:  # a block may be drafted past the budget, then the bonus
            longest = prompt + config.max_new_tokens + config.block_size + 1
            extra, lms = f" + block ({config.block_size}) + 1", [self.target, self.draft]
        limit = min(lm.max_length for lm in lms)
        if longest > limit:
            raise ValueError(
                f"prompt ({prompt} tokens) + max_new_tokens ({config.max_new_tokens}){extra} "
                f"exceeds the model context of {limit} tokens"
            )
        for lm in lms:
            need = lm.bytes_per_token * rows * longest
            if need > lm.max_cache_bytes:
                raise ValueError(
                    f"{lm.name} KV cache for {rows} rows x {longest} positions needs {need / 2**30:.2f} GiB, "
                    f"over the budget of {lm.max_cache_bytes / 2**30:.2f} GiB (max_cache_bytes)"
                )

    def check_request(self, ids: Sequence[int], config: SMCConfig) -> None:
        """Refuse, in one line, an SMC-SD request's prompt: empty, off the vocabulary or too long."""
        self.check_token_prompts([ids])
        self.check_fits([ids], config, True, config.n_particles)

"""The generation methods a user can pick by name, and the contract of their runners.

A runner is ``(context: RunContext) -> list[Generation]``: it gets the pair core (backends,
the row store, the models; never the ``SMCSD`` facade), the settings and the EOS ids, and
returns one ``Generation`` per request (``RunContext.generations``); ``SMCSD`` encodes the
prompts and adds the method's name and the call's stats. Each runner's module registers it with ``@register``;
importing ``smcsd_ppl.methods`` loads them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config import DraftRecord, SMCConfig
from ..ends import finish_reason
from ..engine.client import Engine
from ..engine.pair import PairCore
from ..inference.rows import RowStore
from ..models import LoadedModel
from ..names import METHOD_SUMMARIES
from ..proposals.retrieval import RetrievalDrafter
from ..results import Generation, generation


@dataclass
class RunContext:
    """Everything a runner may use: one batch of requests on one pair.

    Attributes:
        prompts: token ids, one request each.
        config: the settings of the call.
        pair: the pair core: both backends, the row store, the models, text in and out.
        on_progress: called with the length of the longest output so far.
        draft_record: what SMC-SD's adaptive drafting knows of the draft beforehand (None:
            the pair's).
        retrieval: RACER's index and cues kept across calls (None: each call starts empty).
        engine: the pair's engine, where SMC-SD runs (a benchmark's runners run it there too).
    """

    prompts: list[list[int]]
    config: SMCConfig
    pair: PairCore
    on_progress: Callable[[int], None] | None = None
    draft_record: DraftRecord | None = None
    retrieval: RetrievalDrafter | None = None
    engine: Engine | None = None

    def __post_init__(self) -> None:
        if self.draft_record is None:
            self.draft_record = self.pair.draft_record

    target_lm = property(lambda self: self.pair.target_lm, doc="The target's batched backend.")
    draft_lm = property(lambda self: self.pair.draft_lm, doc="The draft's batched backend.")
    target_model = property(lambda self: self.pair.target, doc="The loaded target (HF ``generate`` runners).")
    draft_model = property(lambda self: self.pair.draft, doc="The loaded draft, likewise.")
    encode = property(lambda self: self.pair.encode, doc="Text -> token ids (SMC programs' text prompts).")
    decode = property(lambda self: self.pair.decode, doc="Token ids -> text (SMC programs' particle texts).")

    @property
    def eos(self) -> list[int]:
        """EOS ids in force under ``config`` (empty with ``ignore_eos``)."""
        return self.pair.eos_for(self.config)

    def generations(
        self, token_ids: list[list[int]], info: Sequence[object] = (), messages: Sequence[str] = ()
    ) -> list[Generation]:
        """A runner's outputs: per request its tokens, decoded, why they ended, and the method's report.

        ``info``: per request, the method family's report (``SMCInfo``, ``SpeculativeInfo``), or
        none; ``messages``: why an output is empty or incomplete. The caller adds the method's
        name and the call's stats.
        """
        budget, eos = self.config.max_new_tokens, self.eos
        info, messages = list(info) or [None] * len(token_ids), list(messages) or [""] * len(token_ids)
        return [
            generation("", self.decode(ids), ids, None, finish_reason(ids, budget, eos), message, x)
            for ids, x, message in zip(token_ids, info, messages)
        ]

    def rows(self) -> RowStore:
        """The pair's row store (a runner starts it afresh)."""
        return self.pair.store

    def built_models(self, method: str) -> tuple[LoadedModel, LoadedModel]:
        """Target and draft as PyTorch models, for a method that runs them outside the backends.

        Raises:
            ValueError: the pair was loaded for vLLM only (its models live in their engines).
        """
        target, draft = self.target_model, self.draft_model
        if target is None or draft is None or target.model is None or draft.model is None:
            raise ValueError(
                f"{method} runs the models in PyTorch, outside the backends, and this pair has none "
                "built (a vLLM pair loads its models into its engines only): use the HF backend"
            )
        return target, draft


Runner = Callable[[RunContext], list[Generation]]


@dataclass(frozen=True)
class Method:
    """A named generation method.

    Attributes:
        run: the runner (None for SMC-SD's methods, which the pair's engine runs).
        uses_draft: it feeds the draft model (and may draft past the budget by a block).
        particles: it holds ``n_particles`` rows per prompt.
        summary: one line for help texts.
        samples_target: it samples the target itself (speculative sampling and its
            kin), so it needs ``alpha == 1``.
        settings: SMC-SD's methods, which the pair's engine runs (``Engine.run``): the settings
            a call's config becomes; None for the baselines, which their runners run.
    """

    name: str
    run: Runner | None
    uses_draft: bool
    particles: bool
    summary: str
    samples_target: bool = False
    settings: Callable[[SMCConfig], SMCConfig] | None = None

    def check(self, config: SMCConfig) -> None:
        """Refuse settings this method cannot honour."""
        if self.samples_target and config.alpha != 1.0:
            raise ValueError(f"{self.name} samples the target itself: alpha must be 1, got {config.alpha}")
        if self.run is not None and config.sampling.active:
            raise ValueError(
                f"{self.name} samples the target unprocessed: top_k, top_p, min_p and logit_bias "
                "need an SMC-SD method (smcsd, smcsd_paper)"
            )


METHODS: dict[str, Method] = {}
"""Every registered method by name (filled by ``register``; the baselines register on import)."""


def register(
    name: str,
    *,
    uses_draft: bool = True,
    particles: bool = False,
    samples_target: bool = False,
    summary: str | None = None,
):
    """Decorator adding a runner to ``METHODS`` under ``name``.

    The built-in methods take their one-line ``summary`` from ``names.METHOD_SUMMARIES`` (where
    the command line reads it); a method of your own gives its own.
    """
    summary = METHOD_SUMMARIES.get(name) if summary is None else summary
    if summary is None:
        raise ValueError(f"register({name!r}) needs a summary: a one-line description of the method")

    def add(run: Runner) -> Runner:
        METHODS[name] = Method(name, run, uses_draft, particles, summary, samples_target)
        return run

    return add


def register_smcsd(name: str, settings: Callable[[SMCConfig], SMCConfig]) -> None:
    """Add an SMC-SD method: the pair's engine runs it with ``settings`` (no runner of its own)."""
    METHODS[name] = Method(name, None, True, True, METHOD_SUMMARIES[name], settings=settings)


def get(name: str) -> Method:
    """The method called ``name``, or a ``ValueError`` listing the known ones."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {name!r}")
    return METHODS[name]

"""The generation methods a user can pick by name, and the contract of their runners.

A runner is ``(context: RunContext) -> MethodOutput``: it gets backends, a row-store
factory and the EOS ids (never the ``SMCSD`` facade) and returns token ids per request
with its typed report; ``SMCSD`` encodes the prompts, decodes the outputs and builds
every ``Generation`` with its stats. Each runner's module registers it with ``@register``;
importing ``smcsd_ppl.methods`` loads them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..backends.base import BatchedLM
from ..config import DraftRecord, SMCConfig
from ..inference.rows import RowStore
from ..models import LoadedModel
from ..names import METHOD_SUMMARIES
from ..proposals.retrieval import RetrievalDrafter
from ..results import SMCInfo, SpeculativeInfo


@dataclass
class RunContext:
    """Everything a runner may use: one batch of requests on one pair of backends.

    Attributes:
        prompts: token ids, one request each.
        config: the settings of the call.
        target_lm: the target's batched backend.
        draft_lm: the draft's batched backend.
        eos: EOS ids in force under ``config`` (empty with ``ignore_eos``).
        make_rows: a fresh ``RowStore`` over both backends.
        on_progress: called with the length of the longest output so far.
        target_model: the loaded target, for methods that call Hugging Face ``generate``.
        draft_model: the loaded draft, likewise.
        encode: text -> token ids, for SMC programs whose prompt is a text.
        decode: token ids -> text, for SMC programs' particle texts.
        draft_record: what SMC-SD's adaptive drafting knows of the draft beforehand.
        retrieval: RACER's index and cues kept across calls (None: each call starts empty).
    """

    prompts: list[list[int]]
    config: SMCConfig
    target_lm: BatchedLM
    draft_lm: BatchedLM
    eos: list[int]
    make_rows: Callable[[], RowStore]
    on_progress: Callable[[int], None] | None = None
    target_model: LoadedModel | None = None
    draft_model: LoadedModel | None = None
    encode: Callable[[str], list[int]] | None = None
    decode: Callable[[Sequence[int]], str] | None = None
    draft_record: DraftRecord = field(default_factory=DraftRecord)
    retrieval: RetrievalDrafter | None = None

    def rows(self) -> RowStore:
        """A row store over both backends, for one run."""
        return self.make_rows()

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


@dataclass
class MethodOutput:
    """What a runner returns.

    Attributes:
        token_ids: new token ids per request.
        info: per request, the method family's report (``SMCInfo``, ``SpeculativeInfo``);
            empty when the method reports nothing more.
        texts: per request, the output text when the method decides it (SMC programs);
            None lets the caller decode ``token_ids``.
        messages: per request, why an output is empty or incomplete (empty: none say so).
    """

    token_ids: list[list[int]]
    info: Sequence[SMCInfo | SpeculativeInfo | None] = ()
    texts: list[str] | None = None
    messages: Sequence[str] = ()


Runner = Callable[[RunContext], MethodOutput]


@dataclass(frozen=True)
class Method:
    """A named generation method.

    Attributes:
        run: the runner.
        uses_draft: it feeds the draft model (and may draft past the budget by a block).
        particles: it holds ``n_particles`` rows per prompt.
        summary: one line for help texts.
        samples_target: it samples the target itself (speculative sampling and its
            kin), so it needs ``alpha == 1``.
    """

    name: str
    run: Runner
    uses_draft: bool
    particles: bool
    summary: str
    samples_target: bool = False

    def check(self, config: SMCConfig) -> None:
        """Refuse settings this method cannot honour."""
        if self.samples_target and config.alpha != 1.0:
            raise ValueError(f"{self.name} samples the target itself: alpha must be 1, got {config.alpha}")


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


def get(name: str) -> Method:
    """The method called ``name``, or a ``ValueError`` listing the known ones."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {name!r}")
    return METHODS[name]

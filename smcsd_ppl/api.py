"""High-level API: a target and a draft, ready to generate with SMC-SD, exact SD or AR."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence

from . import methods
from .backends.base import BatchedLM, call_clock, call_stats
from .backends.hf import DEFAULT_CACHE_BUDGET
from .config import DraftRecord, SMCConfig, checked_record
from .engine.client import Engine
from .engine.pair import Execution, PairCore
from .engine.worker import torch_thread
from .inference.program import SMCSDModel
from .inference.rows import RowStore
from .inference.state import StepInfo
from .models import LoadedModel, eos_ids, load_model
from .models.batched import batched_pair
from .models.checkpoint import draft_files, load_files
from .models.drafts import resolve_draft
from .models.loading import cache_root
from .models.threads import BusyCPUWarning, LoadWatch, chosen_by_user, set_threads
from .proposals.retrieval import RetrievalDrafter
from .results import Generation, RunStats
from .text import encode_prompt

BACKENDS = ("hf", "vllm")


class SMCSD:
    """A target and a draft model sharing a tokenizer, with batched backends.

    Calls are reproducible and safe to share: the same call with the same seed returns the
    same output whatever ran before or alongside. Every call's model work runs on the
    process's one torch thread (``engine.worker``): SMC-SD calls from several threads (or
    asyncio tasks, with ``agenerate``) join one running batch (``engine``), each returning
    what it would have returned alone; other methods take the pair's rows in turn.

    Args:
        target: the target model, loaded (see ``smcsd_ppl.models``).
        draft: the draft model, loaded; its tokenizer must have the target's vocabulary.
        chat: wrap text prompts in the tokenizer's chat template (if it has one).
        max_cache_bytes: KV-cache budget of each backend (HF backend).
        backend: ``"hf"`` (batched KV caches in PyTorch, the default and the exactness
            reference) or ``"vllm"`` (both models on vLLM engines; see docs/scaling.md).
        vllm_options: more ``vllm.LLM`` arguments for both engines (``tensor_parallel_size``, ...).
        forward: how the HF backend computes a forward: ``"auto"`` (ours where the model is a
            Llama, its parts compiled where built), ``"compiled"`` (ours, its parts compiled
            now where missing) or ``"reference"`` (the model's own; ``config.FORWARDS``).
        deterministic: a seeded request's forwards have the same shapes alone and among
            batch-mates (both: ``engine.pair.Execution``).
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel,
        *,
        chat: bool = True,
        max_cache_bytes: int = DEFAULT_CACHE_BUDGET,
        backend: str = "hf",
        vllm_options: dict | None = None,
        forward: str = "auto",
        deterministic: bool = False,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        if (
            draft.tokenizer is not target.tokenizer
            and draft.tokenizer.get_vocab() != target.tokenizer.get_vocab()
        ):
            raise ValueError(
                f"draft {draft.name!r} and target {target.name!r} use different tokenizers; "
                "SMC-SD and speculative sampling need the same vocabulary"
            )
        build = functools.partial(
            batched_pair,
            target,
            draft,
            backend=backend,
            max_cache_bytes=max_cache_bytes,
            vllm_options=vllm_options,
            forward=forward,
            deterministic=deterministic,
        )
        # vLLM's engines start on the calling thread (signal handlers); PyTorch's on the torch thread
        target_lm, draft_lm = build() if backend == "vllm" else torch_thread().run(build)
        self.core = PairCore(
            target_lm,
            draft_lm,
            tokenizer=target.tokenizer,
            eos_token_ids=eos_ids(target),
            chat=chat,
            target=target,
            draft=draft,
            execution=Execution(backend, forward, deterministic),
        )
        # RACER's index across calls, only if the caller sets one: later outputs then depend on earlier.
        self.retrieval_memory: RetrievalDrafter | None = None
        self._engine: Engine | None = None

    @classmethod
    def load(
        cls,
        target: str | None = None,
        draft: str | None = None,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        threads: int | None = None,
        draft_record: DraftRecord | None = None,
        **kwargs,
    ) -> SMCSD:
        """Load models by name: hub id, local path, ``None`` for the embedded default.

        ``draft`` may also be ``"layers:N"``, the target's first N layers (a weak draft).
        ``draft_record``: what SMC-SD's requests start from (None: what a distilled draft ships,
        else nothing). With ``backend="vllm"`` no model is built in PyTorch: each engine loads
        its model; the tokenizer and LM heads are read here (``models.checkpoint``). ``threads``:
        torch's CPU threads (default: torch's, or ``OMP_NUM_THREADS``); a busy CPU while the
        models load gets one warning. Loading runs on the process's torch thread, as calls do.
        """
        set_threads(threads)
        draft_record = draft_record if draft_record is None else checked_record(draft_record)  # before cost
        watch = LoadWatch()
        built = functools.partial(cls._built, target, draft, device, dtype, kwargs)
        pair = built() if kwargs.get("backend") == "vllm" else torch_thread().run(built)  # see __init__
        load = watch.stop() if str(device).startswith("cpu") and not chosen_by_user(threads) else None
        if load is not None and load.busy:
            note = f"{load.describe()}; pass threads=N to SMCSD.load, or set OMP_NUM_THREADS, to choose"
            warnings.warn(note, BusyCPUWarning, stacklevel=2)
        pair.draft_record = pair.draft_record if draft_record is None else draft_record
        return pair

    @classmethod
    def _built(cls, target, draft, device, dtype, kwargs) -> SMCSD:
        if kwargs.get("backend") == "vllm":  # not installed: say so before loading anything
            from .backends.vllm import import_vllm

            import_vllm()
            t = load_files(target, device=device, dtype=dtype)
            return cls(t, draft_files(draft, t, cache_root()), **kwargs)
        t = load_model(target, device=device, dtype=dtype)
        return cls(t, resolve_draft(draft, t, device=device, dtype=dtype), **kwargs)

    target = property(lambda self: self.core.target, doc="The loaded target.")
    draft = property(lambda self: self.core.draft, doc="The loaded draft.")
    target_lm = property(lambda self: self.core.target_lm, doc="The target's batched backend.")
    draft_lm = property(lambda self: self.core.draft_lm, doc="The draft's batched backend.")
    tokenizer = property(lambda self: self.core.tokenizer, doc="The shared tokenizer.")
    chat = property(lambda self: self.core.chat, doc="Whether text prompts get the chat template.")
    eos_token_ids = property(lambda self: self.core.eos_token_ids, doc="The target's EOS ids.")
    backend = property(lambda self: self.core.backend, doc="What runs the models: ``hf`` or ``vllm``.")

    draft_record = property(
        lambda self: self.core.draft_record,
        lambda self, record: setattr(self.core, "draft_record", checked_record(record)),
        doc="What SMC-SD's adaptive drafting knows of this draft before a request (assign to change).",
    )

    def calibrate(self, prompt: str, config: SMCConfig | None = None) -> DraftRecord:
        """Learn how far this draft pays here from one request: later requests start from that record."""
        config = config or SMCConfig()

        record = DraftRecord()
        if config.cut is not None:
            ids = [self.encode(prompt)]
            self.check_fits(ids, config, methods.get("smcsd"))
            [ticket] = self.engine.run([SMCSDModel(ids[0])], config, record=record)
            record = ticket.wait().smc.draft_record
        self.draft_record = record
        return record

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (chat template applied for instruct models)."""
        return encode_prompt(self.tokenizer, prompt, chat=self.chat)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens dropped), up to its last whole character (as streamed)."""
        return self.core.decode(ids)

    def rows(self) -> RowStore:
        """The pair's row store, for custom loops (run them with ``call``, or hold ``lock``)."""
        return self.core.store

    @property
    def engine(self) -> Engine:
        """The engine that owns this pair's rows: every SMC-SD call is a request of its batch."""
        if self._engine is None:
            self._engine = Engine(self.core)
        return self._engine

    def use_engine(self, engine: Engine) -> None:
        """Make ``engine`` (built over this pair's core, e.g. with a server's limits) the pair's own."""
        if self._engine is not None and self._engine is not engine:
            self._engine.close()
        self._engine = engine

    def close(self) -> None:
        """Finish the requests running (a later call makes a new engine)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def use_draft_backend(self, draft_lm: BatchedLM) -> None:
        """Draft with another backend from the next call on (a mixture, an adapter): before any call."""
        if self._engine is not None:
            raise RuntimeError("use_draft_backend must come before the pair's first call")
        self.core = self.core.with_draft(draft_lm)

    def call(self, fn: Callable[[], object]) -> object:
        """``fn()`` on the torch thread with the pair's rows to itself (the batch drains first)."""
        return self.engine.call(fn)

    @property
    def lock(self):
        """A context manager that has the pair's rows to itself while held (prefer ``call``)."""
        return self.engine.exclusive()

    def eos_for(self, config: SMCConfig) -> list[int]:
        """EOS ids in force under ``config`` (none with ``ignore_eos``)."""
        return self.core.eos_for(config)

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        method: str = "smcsd",
        config: SMCConfig | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> Generation | list[Generation]:
        """Generate a continuation of each prompt, all prompts batched.

        Args:
            prompts: one text or a list of texts.
            method: a name in ``methods.METHODS``: ``"smcsd"`` (default), ``"sd"`` (exact
                speculative sampling), ``"ar"`` (autoregressive), and the other baselines.
            config: settings (``SMCConfig``); SD uses K, T_d, T_t; AR uses T_t.
            on_progress: called with the length of the longest output so far.
        """
        chosen = methods.get(method)  # an unknown name fails before anything is encoded
        single = isinstance(prompts, (str, bytes, bytearray))
        texts = [prompts] if single else list(prompts)
        if not texts:
            raise ValueError("no prompts: give a text or a non-empty list of texts")
        ids = [self.encode(p) for p in texts]
        outs = self._generate(ids, chosen, config or SMCConfig(), on_progress)
        return outs[0] if single else outs

    async def agenerate(self, prompts: str | Sequence[str], **kwargs) -> Generation | list[Generation]:
        """``generate`` from asyncio code: it waits on a worker thread, so the event loop keeps going."""
        return await asyncio.to_thread(self.generate, prompts, **kwargs)

    def generate_ids(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        method: str = "smcsd",
        config: SMCConfig | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Generation]:
        """``generate`` for prompts given as token ids (no chat template is applied)."""
        chosen = methods.get(method)
        if not prompt_ids:
            raise ValueError("no prompts: give a non-empty list of token-id prompts")
        self.core.check_token_prompts(prompt_ids)
        ids = [[int(t) for t in p] for p in prompt_ids]
        return self._generate(ids, chosen, config or SMCConfig(), on_progress)

    def run(
        self,
        programs: Sequence[SMCSDModel],
        config: SMCConfig | None = None,
        on_cycle: Callable[[StepInfo], None] | None = None,
    ) -> list[Generation]:
        """Run user programs (``SMCSDModel`` subclasses), one request each, in one batch.

        ``on_cycle`` is called after each cycle (on the torch thread) with the cycle's
        ``StepInfo``, its populations those of these programs in order.
        """
        programs = [programs] if isinstance(programs, SMCSDModel) else list(programs)
        for p in programs:
            if not isinstance(p, SMCSDModel):
                raise ValueError(
                    f"run takes SMCSDModel programs, got a {type(p).__name__}: wrap a text as "
                    "SMCSDModel(prompt) (or SMCSDModel(prompt, constraint)), or call generate"
                )
        self.core.check_token_prompts([p.prompt for p in programs if not isinstance(p.prompt, str)])
        return self._batched(programs, config or SMCConfig(), "smcsd", on_cycle=on_cycle)

    def check_request(self, ids: list[int], config: SMCConfig) -> None:
        """Refuse, in one line, a token-id prompt that is empty, off the vocabulary or past the context."""
        self.core.check_request(ids, config)

    def check_fits(self, ids: list[list[int]], config: SMCConfig, method: methods.Method) -> None:
        """Refuse up front what would fail mid-generation (context length, KV budget)."""
        rows = len(ids) * (config.n_particles if method.particles else 1)
        self.core.check_fits(ids, config, method.uses_draft, rows)

    def _generate(
        self,
        ids: list[list[int]],
        method: methods.Method,
        config: SMCConfig,
        on_progress: Callable[[int], None] | None,
    ) -> list[Generation]:
        """Run ``method`` on token-id prompts and build each request's ``Generation``."""
        method.check(config)
        self.check_fits(ids, config, method)
        if method.settings is not None:
            programs = [SMCSDModel(i) for i in ids]
            return self._batched(programs, method.settings(config), method.name, on_progress)
        context = self.context(config, ids, on_progress)

        def run() -> list[Generation]:
            start = self.start_clock()
            return self._generations(method.name, method.run(context), start)

        return self.call(run)

    def _batched(
        self,
        programs: list[SMCSDModel],
        config: SMCConfig,
        name: str,
        on_progress: Callable[[int], None] | None = None,
        on_cycle: Callable[[StepInfo], None] | None = None,
    ) -> list[Generation]:
        """Each program as a request of the engine's batch (request i seeded as in a run of its own)."""
        start = self.start_clock()

        def observe(info: StepInfo) -> None:
            if on_progress is not None:
                on_progress(info.tokens)
            if on_cycle is not None:
                on_cycle(info)

        observer = observe if on_progress or on_cycle else None
        outs = [t.wait() for t in self.engine.run(programs, config, observer=observer)]
        return self._generations(name, outs, start)

    def context(
        self,
        config: SMCConfig | None = None,
        prompts: Sequence[Sequence[int]] = (),
        on_progress: Callable[[int], None] | None = None,
        *,
        record: DraftRecord | None = None,
    ) -> methods.RunContext:
        """What a runner gets of this pair (run the runner on the torch thread: ``call``).

        ``record``: the draft record SMC-SD starts from (``draft_record`` when None).
        """
        config = config or SMCConfig()
        prompts = [list(p) for p in prompts]
        memory = self.retrieval_memory
        return methods.RunContext(prompts, config, self.core, on_progress, record, memory, self.engine)

    def _generations(self, name: str, outs: list[Generation], start: tuple) -> list[Generation]:
        """A runner's outputs, named by its method, sharing the call's stats."""
        stats = self.stats(name, start, sum(len(g.token_ids) for g in outs))
        return [dataclasses.replace(g, method=name, stats=stats) for g in outs]

    def start_clock(self) -> tuple[float, ...]:
        """The time and the forward counters now, for ``stats`` (counters are never reset)."""
        return call_clock(self.target_lm, self.draft_lm)

    def stats(self, method: str, start: tuple[float, ...], new_tokens: int) -> RunStats:
        """Cost of the call begun at ``start`` (shared with the requests of its batch, if it joined one)."""
        return call_stats(method, start, self.target_lm, self.draft_lm, new_tokens)

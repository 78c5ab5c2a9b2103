"""High-level API: a target and a draft, ready to generate with SMC-SD, exact SD or AR."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable, Sequence

from . import methods
from .backends.base import call_clock, call_stats
from .backends.hf import DEFAULT_CACHE_BUDGET
from .config import DraftRecord, SMCConfig
from .inference.program import SMCSDModel
from .inference.rows import RowStore
from .inference.state import StepInfo
from .inference.step import request_seed
from .models import LoadedModel, eos_ids, load_model
from .models.batched import batched_pair
from .models.checkpoint import draft_files, load_files
from .models.drafts import resolve_draft
from .models.loading import cache_root
from .models.threads import choose_threads
from .proposals.retrieval import RetrievalDrafter
from .results import Generation, RunStats, SMCInfo, SpeculativeInfo
from .serving.scheduler import Scheduler
from .text import check_token_ids, encode_prompt, whole_characters

BACKENDS = ("hf", "vllm")
# The methods whose requests join the running batch, and the settings each runs with.
BATCHED = {"smcsd": lambda c: c, "smcsd_paper": lambda c: dataclasses.replace(c, cut=None)}


class SMCSD:
    """A target and a draft model sharing a tokenizer, with batched backends.

    Calls are reproducible and safe to share: the same call with the same seed returns the
    same output whatever ran before or alongside. SMC-SD calls from several threads (or
    asyncio tasks, with ``agenerate``) join one running batch (``scheduler``), each returning
    what it would have returned alone; other methods and settings take the pair in turn.

    Args:
        target: the target model, loaded (see ``smcsd_ppl.models``).
        draft: the draft model, loaded; its tokenizer must have the target's vocabulary.
        chat: wrap text prompts in the tokenizer's chat template when it has one.
        max_cache_bytes: KV-cache budget of each backend (HF backend).
        backend: ``"hf"`` (batched KV caches in PyTorch, the default and the exactness
            reference) or ``"vllm"`` (both models on vLLM engines; see docs/scaling.md).
        vllm_options: more ``vllm.LLM`` arguments for both engines (``tensor_parallel_size``,
            ``max_model_len``, ...).
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
        self.target, self.draft, self.chat = target, draft, chat
        self.tokenizer = target.tokenizer
        self.backend = backend
        self.target_lm, self.draft_lm = batched_pair(
            target, draft, backend=backend, max_cache_bytes=max_cache_bytes, vllm_options=vllm_options
        )
        self.eos_token_ids = eos_ids(target)
        # What SMC-SD's adaptive drafting knows of this draft before a request: a value each
        # request starts from and none changes (assign a learned one to change it).
        self.draft_record = DraftRecord()
        # RACER's index and cues, kept across calls only if the caller sets one (as the RACER
        # reference does): faster on repeated content, but later outputs depend on earlier calls.
        self.retrieval_memory: RetrievalDrafter | None = None
        self._scheduler: Scheduler | None = None  # owns the backends' rows once started
        self._starting = threading.Lock()

    @classmethod
    def load(
        cls,
        target: str | None = None,
        draft: str | None = None,
        *,
        device: str = "cpu",
        dtype: str = "bfloat16",
        threads: int | None = None,
        **kwargs,
    ) -> SMCSD:
        """Load models by name: hub id, local path, ``None`` for the embedded default.

        ``draft`` may also be ``"layers:N"``, the target's first N layers (a weak draft). With
        ``backend="vllm"`` no model is built in PyTorch: each engine loads its model, and only
        the tokenizer and the LM heads are read here (``models.checkpoint``).
        ``threads`` sets torch's CPU threads; by default a busy machine's CPU runs as many as
        its load leaves free (see ``models.threads``), and one warning says so.
        """
        choice = choose_threads(threads) if threads is not None or str(device).startswith("cpu") else None
        if choice is not None:
            warnings.warn(
                f"{choice.describe()}; pass threads=N to SMCSD.load, or set OMP_NUM_THREADS, to choose",
                stacklevel=2,
            )
        if kwargs.get("backend") == "vllm":  # not installed: say so before loading anything
            from .backends.vllm import import_vllm

            import_vllm()
            t = load_files(target, device=device, dtype=dtype)
            return cls(t, draft_files(draft, t, cache_root()), **kwargs)
        t = load_model(target, device=device, dtype=dtype)
        return cls(t, resolve_draft(draft, t, device=device, dtype=dtype), **kwargs)

    def calibrate(self, prompt: str, config: SMCConfig | None = None) -> DraftRecord:
        """Learn from one request how far this draft pays, and start every later request from that.

        Requests start from ``draft_record``; this replaces it with what one request, started
        from nothing, saw of the draft. It changes outputs (and speed) of later calls in a
        documented way; nothing else does.
        """
        config = config or SMCConfig()
        with self.lock:
            record = DraftRecord()
            if config.cut is not None:
                ids = [self.encode(prompt)]
                self.check_fits(ids, config, methods.get("smcsd"))
                out = methods.get("smcsd").run(self.context(config, ids, record=record))
                record = out.info[0].draft_record
            self.draft_record = record
            return record

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (chat template applied for instruct models)."""
        return encode_prompt(self.tokenizer, prompt, chat=self.chat)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens dropped), up to its last whole character (as streamed)."""
        return whole_characters(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def rows(self) -> RowStore:
        """A row store over this pair's backends, for custom loops (hold ``lock`` while using it)."""
        return RowStore(self.target_lm, self.draft_lm)

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler that owns this pair's rows (started on first use; see ``use_scheduler``)."""
        with self._starting:
            if self._scheduler is None:
                self._scheduler = Scheduler(self)
            return self._scheduler

    def use_scheduler(self, scheduler: Scheduler) -> None:
        """Make ``scheduler`` (built over this pair, e.g. with a server's limits) the pair's own."""
        with self._starting:
            if self._scheduler is not None and self._scheduler is not scheduler:
                self._scheduler.close()
            self._scheduler = scheduler

    def close(self) -> None:
        """Finish the requests running and stop the scheduler (a later call starts a new one)."""
        with self._starting:
            sched, self._scheduler = self._scheduler, None
        if sched is not None:
            sched.close()

    @property
    def lock(self):
        """A context manager that has the backends' rows to itself while held (reentrant)."""
        return self.scheduler.exclusive()

    def eos_for(self, config: SMCConfig) -> list[int]:
        """EOS ids in force under ``config`` (none with ``ignore_eos``)."""
        return [] if config.ignore_eos else self.eos_token_ids

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
        """``generate`` from asyncio code: runs on a worker thread, so the event loop keeps going."""
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
        self._check_token_prompts(prompt_ids)
        ids = [[int(t) for t in p] for p in prompt_ids]
        return self._generate(ids, chosen, config or SMCConfig(), on_progress)

    def run(
        self,
        programs: Sequence[SMCSDModel],
        config: SMCConfig | None = None,
        on_cycle: Callable[[StepInfo], None] | None = None,
    ) -> list[Generation]:
        """Run user programs (``SMCSDModel`` subclasses), one request each, in one batch."""
        programs = [programs] if isinstance(programs, SMCSDModel) else list(programs)
        for p in programs:
            if not isinstance(p, SMCSDModel):
                raise ValueError(
                    f"run takes SMCSDModel programs, got a {type(p).__name__}: wrap a text as "
                    "SMCSDModel(prompt) (or SMCSDModel(prompt, constraint)), or call generate"
                )
        self._check_token_prompts([p.prompt for p in programs if not isinstance(p.prompt, str)])
        config = config or SMCConfig()
        if on_cycle is None and self._joins_batch(config):
            return self._batched(programs, config, "smcsd", None)
        context = self.context(config)  # the programs hold the prompts
        with self.lock:
            start = self.start_clock()
            out = methods.run_programs(context, list(programs), on_cycle)
            return self._generations("smcsd", out, start)

    def check_request(self, ids: list[int], config: SMCConfig) -> None:
        """Refuse, in one line, a token-id prompt that is empty, off the vocabulary or past the context."""
        self._check_token_prompts([ids])
        self.check_fits([ids], config, methods.get("smcsd"))

    def _check_token_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """Refuse a token-id prompt that is empty or holds ids outside the target's vocabulary."""
        model = self.target.model
        vocab = self.target_lm.vocab_size if model is None else model.get_input_embeddings().num_embeddings
        for p in prompts:
            check_token_ids(p, vocab)

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
        if method.name in BATCHED and self._joins_batch(effective := BATCHED[method.name](config)):
            return self._batched([SMCSDModel(i) for i in ids], effective, method.name, on_progress)
        context = self.context(config, ids, on_progress)
        with self.lock:
            start = self.start_clock()
            return self._generations(method.name, method.run(context), start)

    def _joins_batch(self, config: SMCConfig) -> bool:
        """Whether a call with ``config`` joins the running batch (else it takes the pair in turn)."""
        sched = self.scheduler
        return self.retrieval_memory is None and sched.shares(config) and not sched.held_here

    def _batched(
        self,
        programs: list[SMCSDModel],
        config: SMCConfig,
        name: str,
        on_progress: Callable[[int], None] | None,
    ) -> list[Generation]:
        """Each program as a request of the running batch (request i seeded as in a run of its own)."""
        start = self.start_clock()
        longest = [0] * len(programs)

        def progress(i: int, n: int) -> None:
            longest[i] = n
            on_progress(max(longest))

        tickets = [
            self.scheduler.submit_program(
                p,
                config,
                seed=request_seed(config.seed, i),
                bounded=False,
                on_progress=None if on_progress is None else functools.partial(progress, i),
            )
            for i, p in enumerate(programs)
        ]
        outs = [t.wait() for t in tickets]
        stats = self.stats(name, start, sum(len(g.token_ids) for g in outs))
        return [dataclasses.replace(g, method=name, stats=stats) for g in outs]

    def context(
        self,
        config: SMCConfig | None = None,
        prompts: Sequence[Sequence[int]] = (),
        on_progress: Callable[[int], None] | None = None,
        *,
        record: DraftRecord | None = None,
    ) -> methods.RunContext:
        """What a runner gets of this pair: backends, a row-store factory, EOS ids, the models, text.

        Args:
            config: the settings of the call (``SMCConfig()`` when None).
            prompts: token-id prompts, one request each (none for SMC programs, which hold theirs).
            on_progress: called with the length of the longest output so far.
            record: the draft record SMC-SD starts from (``draft_record`` when None).
        """
        config = config or SMCConfig()
        return methods.RunContext(
            [list(p) for p in prompts],
            config,
            self.target_lm,
            self.draft_lm,
            self.eos_for(config),
            self.rows,
            on_progress,
            target_model=self.target,
            draft_model=self.draft,
            encode=self.encode,
            decode=self.decode,
            draft_record=self.draft_record if record is None else record,
            retrieval=self.retrieval_memory,
        )

    def _generations(self, name: str, out: methods.MethodOutput, start: tuple) -> list[Generation]:
        """One ``Generation`` per request, sharing the call's stats; decoded unless the method gave texts."""
        stats = self.stats(name, start, sum(len(t) for t in out.token_ids))
        texts = out.texts if out.texts is not None else [self.decode(t) for t in out.token_ids]
        info = list(out.info) or [None] * len(texts)
        messages = list(out.messages) or [""] * len(texts)
        return [
            Generation(
                text,
                ids,
                name,
                stats,
                message,
                smc=x if isinstance(x, SMCInfo) else None,
                speculative=x if isinstance(x, SpeculativeInfo) else None,
            )
            for text, ids, x, message in zip(texts, out.token_ids, info, messages)
        ]

    def check_fits(self, ids: list[list[int]], config: SMCConfig, method: methods.Method) -> None:
        """Refuse up front what would fail mid-generation (context length, KV budget)."""
        prompt = max(len(i) for i in ids)
        if not method.uses_draft:  # the last sampled token is never fed
            longest, extra, lms = prompt + config.max_new_tokens - 1, "", [self.target_lm]
        else:  # a block may be drafted past the budget, then the bonus
            longest = prompt + config.max_new_tokens + config.block_size + 1
            extra, lms = f" + block ({config.block_size}) + 1", [self.target_lm, self.draft_lm]
        limit = min(lm.max_length for lm in lms)
        if longest > limit:
            raise ValueError(
                f"prompt ({prompt} tokens) + max_new_tokens ({config.max_new_tokens}){extra} "
                f"exceeds the model context of {limit} tokens"
            )
        rows = len(ids) * (config.n_particles if method.particles else 1)
        for lm in lms:
            need = lm.bytes_per_token * rows * longest
            if need > lm.max_cache_bytes:
                raise ValueError(
                    f"{lm.name} KV cache for {rows} rows x {longest} positions needs {need / 2**30:.2f} GiB, "
                    f"over the budget of {lm.max_cache_bytes / 2**30:.2f} GiB (max_cache_bytes)"
                )

    def start_clock(self) -> tuple[float, ...]:
        """The time and the forward counters now, for ``stats`` (counters are never reset)."""
        return call_clock(self.target_lm, self.draft_lm)

    def stats(self, method: str, start: tuple[float, ...], new_tokens: int) -> RunStats:
        """Cost of the call begun at ``start`` (shared with the requests of its batch, if it joined one)."""
        return call_stats(method, start, self.target_lm, self.draft_lm, new_tokens)

"""What a server is started with, as one typed record, and the one function that builds it.

``smcsd serve``, ``smcsd load-test`` and each Ray Serve replica build their app with
``build_server``; none of them reads another tool's argument namespace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import DraftRecord, SMCConfig

CORE_PLACES = ("process", "thread")  # where the engine's core may run


@dataclass(frozen=True)
class PairSpec:
    """How an engine process gets its pair: ``SMCSD.load``'s arguments, or a picklable ``factory()``."""

    target: str | None = None
    draft: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = None
    chat: bool = True
    backend: str = "hf"
    vllm_options: dict = field(default_factory=dict)
    draft_record: DraftRecord | None = None
    forward: str = "auto"
    deterministic: bool = False
    factory: Callable[[], object] | None = None

    def load(self):
        """The ``SMCSD`` pair (in an engine process, or here)."""
        if self.factory is not None:
            return self.factory()
        from ..api import SMCSD

        options = dict(chat=self.chat, backend=self.backend, vllm_options=self.vllm_options or None)
        options |= dict(
            draft_record=self.draft_record, forward=self.forward, deterministic=self.deterministic
        )
        return SMCSD.load(
            self.target, self.draft, device=self.device, dtype=self.dtype, threads=self.threads, **options
        )


@dataclass(frozen=True)
class ServeSettings:
    """A server's settings.

    Attributes:
        pair: how the pair loads (in the engine process, or here).
        defaults: a request's settings where it sets none; the fields a request cannot set
            (alpha, cut, resampling, ...) hold for all.
        model_name: the id clients name (None: the target's name).
        api_key: the bearer token the ``/v1`` routes require (None: open).
        max_queue: requests that may wait beyond the rows; more get 429.
        max_rows: KV-cache rows the running requests may hold (N per request).
        max_body_bytes: the largest request body; more get 413.
        core: where the engine's core runs: ``"process"`` (a child process: HTTP and the cycles
            never share an interpreter lock) or ``"thread"`` (in this process, on its torch thread).
        core_timeout: a core process that ends no cycle for this long while requests are in is
            killed as hung, and the server stops (0: never).
    """

    pair: PairSpec = field(default_factory=PairSpec)
    defaults: SMCConfig = field(default_factory=SMCConfig)
    model_name: str | None = None
    api_key: str | None = None
    max_queue: int = 64
    max_rows: int = 512
    max_body_bytes: int = 1 << 20
    core: str = "process"
    core_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not self.core_timeout >= 0:
            raise ValueError(f"--core-timeout must be at least 0, got {self.core_timeout}")
        for name in ("max_queue", "max_rows", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty")
        if self.core not in CORE_PLACES:
            raise ValueError(f"core must be one of {', '.join(CORE_PLACES)}, got {self.core!r}")


def build_server(settings: ServeSettings, pair=None):
    """The ASGI app of ``settings``; with ``pair`` (a loaded ``SMCSD``), its engine runs over that pair here.

    The app owns its engine: its shutdown closes it (and ends an engine process).
    """
    from ..engine.client import Engine
    from ..engine.process import EngineProcess
    from ..potentials.spec import ConstraintSpec
    from .app import build_app

    limits = dict(max_queue=settings.max_queue, max_rows=settings.max_rows)
    if pair is None and settings.core == "thread":
        pair = settings.pair.load()
        pair.core.build_forwards(background=True)  # answers at once; compiled parts as they come
    if pair is not None:
        engine = Engine(pair.core, settings.defaults, **limits, keep_draft=True)  # requests come one by one
        pair.use_engine(engine)  # the pair's own calls share the server's batch
    else:
        engine = EngineProcess(settings.pair, settings.defaults, **limits, hang_seconds=settings.core_timeout)
    # The grammar engine's view of the tokenizer, built now (seconds of work) rather than
    # inside the first constrained request, where it would hold up every other one.
    ConstraintSpec("regex", "a").build(engine.tokenizer, engine.pair.eos_for(settings.defaults))
    return build_app(
        engine,
        model_name=settings.model_name or engine.names["target"],
        defaults=settings.defaults,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
    )

"""One call's run of SMC-SD over a row store, driven here: the engine core, stepped until it is done.

The single call, a recording, steering and the engine's thread all drive the same
``EngineCore``; this is the caller-driven form, for a run of one's own (a custom loop, a
test over mock backends, a runner already on the torch thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from ..config import DraftRecord, SMCConfig
from ..inference.outcome import SMCResult, result_of
from ..inference.program import SMCSDModel
from ..inference.rows import RowStore
from ..inference.state import Population, StepInfo
from ..inference.step import request_seed
from .core import EngineCore
from .pair import PairCore
from .request import Request, Reshape


async def run_requests(core: EngineCore, requests: Sequence[Request]) -> list[Population]:
    """Add ``requests`` to ``core`` and step it until they are done; their final populations, in order.

    The first failure is raised.
    """
    for r in requests:
        core.add(r)
    done: dict[str, Population] = {}
    while core.has_work:
        for out in await core.astep():
            if out.error is not None:
                raise out.error
            if out.population is not None:
                done[out.id] = out.population
    return [done[r.id] for r in requests]


def core_over(store: RowStore, config: SMCConfig, eos: Sequence[int], decode, encode, record) -> EngineCore:
    """An engine core over ``store`` whose batch runs ``config``, with no row limit of its own.

    ``decode`` and ``encode``: text of ids and ids of text (default: ids as text, no encode);
    ``record``: what is known of the draft before the run.
    """
    pair = PairCore.over(store, eos, decode=decode or _ids_text, encode=encode)
    pair.draft_record = record
    return EngineCore(pair, config, max_rows=2**62)


async def final_populations(
    core: EngineCore,
    programs: Sequence[SMCSDModel],
    config: SMCConfig,
    *,
    on_cycle: Callable[[StepInfo], None] | None = None,
    reshape: Reshape | None = None,
) -> list[Population]:
    """Run ``programs`` as one batch of ``core``, request i seeded ``request_seed(config.seed, i)``.

    Returns their final populations, in order, and closes the core. ``on_cycle`` is called
    after every step (these requests, in order); ``reshape`` changes every request's
    population around each step (``inference.steer.Steering``).
    """
    requests = [
        Request(p, config, request_seed(config.seed, i), observer=on_cycle, reshape=reshape)
        for i, p in enumerate(programs)
    ]
    try:
        return await run_requests(core, requests)
    finally:
        core.close()


async def smc_sd(
    programs: Sequence[SMCSDModel],
    store: RowStore,
    config: SMCConfig,
    eos: Sequence[int],
    *,
    record: DraftRecord | None = None,
    **kwargs,
) -> list[SMCResult]:
    """Run SMC-SD for several requests at once, each with up to ``config.n_particles`` particles.

    Every step advances all live particles of all requests; their draft forwards and the
    one fused target forward are shared through the row store. Resampling is per request.
    The outputs depend on the programs, the config (its seed included) and ``record`` only.

    Args:
        programs: one initial ``SMCSDModel`` per request (copied into its particles).
        store: the rows of the draft and the target backends.
        config: the run's settings.
        eos: EOS ids in force.
        record: what is known of the draft before the run (default: nothing; it probes).
        kwargs: ``encode`` and ``decode`` (text of the programs' strings; default: ids as
            text), ``on_cycle`` and ``reshape`` (as ``final_populations`` takes them).
    """
    record = record or DraftRecord()
    core = core_over(store, config, eos, kwargs.pop("decode", None), kwargs.pop("encode", None), record)
    pops = await final_populations(core, programs, config, **kwargs)
    return [result_of(pop, core.kernel, record) for pop in pops]


def run_smc_sd(
    programs: Sequence[SMCSDModel], store: RowStore, config: SMCConfig, eos: Sequence[int], **kwargs
) -> list[SMCResult]:
    """Synchronous wrapper of ``smc_sd`` (use the coroutine inside a running event loop)."""
    return asyncio.run(smc_sd(programs, store, config, eos, **kwargs))


def _ids_text(ids: Sequence[int]) -> str:
    return " ".join(map(str, ids))

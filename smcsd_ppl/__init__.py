"""SMC speculative decoding as a probabilistic-programming extension of LLaMPPL.

The public names load on first use (PEP 562), so that ``import smcsd_ppl`` and
``smcsd --help`` do not pay for torch, transformers and llamppl.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the submodule that defines it
_EXPORTS = {
    "SMCConfig": "config",
    "SMCSD": "api",
    "Generation": "results",
    "RunStats": "results",
    "BlockEngine": "inference.engine",
    "SMCSDModel": "inference.program",
    "SMCResult": "inference.loop",
    "smc_sd": "inference.loop",
    "run_smc_sd": "inference.loop",
    "LoadedModel": "models.loading",
    "load_model": "models.loading",
}

__all__ = [  # noqa: RUF022 (the order of _EXPORTS)
    "SMCConfig",
    "SMCSD",
    "Generation",
    "RunStats",
    "BlockEngine",
    "SMCSDModel",
    "SMCResult",
    "smc_sd",
    "run_smc_sd",
    "LoadedModel",
    "load_model",
]

if TYPE_CHECKING:
    from .api import SMCSD
    from .config import SMCConfig
    from .inference.engine import BlockEngine
    from .inference.loop import SMCResult, run_smc_sd, smc_sd
    from .inference.program import SMCSDModel
    from .models import LoadedModel, load_model
    from .results import Generation, RunStats


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
